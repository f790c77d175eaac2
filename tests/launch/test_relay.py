"""Signals and console of a launch, without training (finetune/launch/relay.py, finetune/console.py):
`finetune train` relays a signal to each rank once, only once the rank catches it; a process whose
console reader went away keeps running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from finetune.launch import relay
from tests.conftest import REPO

# A stand-in rank: after a delay it catches SIGTERM (writes how many it got), then lives a while.
CATCHER = textwrap.dedent(
    """
    import signal, sys, time
    got = []
    time.sleep(float(sys.argv[1]))
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    end = time.monotonic() + 4
    while time.monotonic() < end:
        time.sleep(0.05)
    sys.exit(10 + len(got))
    """
)


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], **kw)


def test_the_relay_signals_each_rank_once_and_only_once_it_catches_the_signal():
    """SIGTERM twice to the wrapper while one rank is still starting (it catches SIGTERM only after
    0.5 s) and another never catches it: the first gets exactly one relayed SIGTERM once it can
    handle it (exit 11: one received; a SIGTERM before its handler would have killed it, -15), the
    second is left alone (exit 0 after its sleep), the wrapper records both signals and says so."""
    with relay.Relay() as r:
        assert os.environ[relay.ENV] == str(r.state_dir)
        late = _python(CATCHER, "0.5")
        never = _python("import time; time.sleep(2)")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # the second: not relayed again
        note = json.loads((r.state_dir / relay.RELAYED).read_text())
        codes = (late.wait(timeout=30), never.wait(timeout=30))
        assert r.signals == [signal.SIGTERM, signal.SIGTERM]
    assert codes == (11, 0), codes
    assert note == {"signal": "SIGTERM", "pid": os.getpid()}
    assert not r.state_dir.exists() and relay.ENV not in os.environ
    assert signal.getsignal(signal.SIGTERM) is not r._handler  # noqa: SLF001 - restored on exit


def test_catches_reads_the_signal_mask_of_a_process():
    proc = _python(CATCHER, "0")
    try:
        deadline = time.monotonic() + 20
        while not relay.catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.catches(proc.pid, signal.SIGTERM)
        assert not relay.catches(proc.pid, signal.SIGHUP)  # Python leaves SIGHUP at its default
    finally:
        proc.kill()
        proc.wait()


# Prints 200 lines to stdout and stderr, slowly, then writes a file saying it got to the end.
WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    if sys.argv[1] == "guarded":
        from finetune.console import guard_streams
        guard_streams()
    for i in range(200):
        print("out", i, flush=True)
        print("err", i, file=sys.stderr, flush=True)
        time.sleep(0.005)
    open(sys.argv[3], "w").write("done")
    """
)


@pytest.mark.parametrize("mode", ["guarded", "plain"])
def test_a_process_whose_console_reader_died_runs_to_its_end_when_guarded(tmp_path, mode):
    """`| tee` killed by Ctrl-C: the reader of stdout and stderr goes away. Guarded, the writer goes
    on to its end and exits 0; plain (the control) it dies of BrokenPipeError."""
    done = tmp_path / "done"
    proc = _python(WRITER, mode, str(REPO), str(done), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdout.readline()
    proc.stdout.close()  # the reader is gone
    code = proc.wait(timeout=60)
    if mode == "guarded":
        assert code == 0 and done.read_text() == "done"
    else:
        assert code != 0 and not done.exists()


# A stand-in rank under a launcher (LOCAL_RANK set): it asks for SIGTERM when its parent dies, and
# records a SIGTERM as the rank's handler does.
ORPHAN = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from finetune.training import signals
    def record(*_):  # written whole, then renamed: the test reads it as soon as it exists
        with open(sys.argv[2] + ".tmp", "w") as f:
            f.write("SIGTERM")
        os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    signal.signal(signal.SIGTERM, record)
    signals.stop_with_parent()
    print("ready", flush=True)
    end = time.monotonic() + 30
    while time.monotonic() < end and not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    """
)


@pytest.mark.parametrize("launched", [True, False])
def test_a_rank_whose_launcher_is_killed_gets_sigterm(tmp_path, launched):
    """The launcher SIGKILLed (nothing left to relay): its rank gets SIGTERM from the kernel and
    stops as if preempted. A process not started by a launcher (no LOCAL_RANK; the control) does not."""
    got = tmp_path / "got"
    env = {**os.environ, "LOCAL_RANK": "0"} if launched else {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.Popen(sys.argv[1:]).wait()",
            sys.executable,
            "-c",
            ORPHAN,
            str(REPO),
            str(got),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert launcher.stdout.readline().strip() == "ready"
        launcher.kill()
        launcher.wait()
        # the kernel sends it as the launcher dies; the control waits long enough to have seen it
        deadline = time.monotonic() + (20 if launched else 3)
        while not got.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if launched:
            assert got.read_text() == "SIGTERM"
        else:
            assert not got.exists()
    finally:
        got.write_text("done")  # lets a waiting stand-in end
