"""A real two-node SLURM cluster on this machine, for the multi-node tests (docs/multinode.md).

Debian's slurm-wlm runs several slurmd daemons on one host, one per node name (`slurmd -N node1`),
each on its own loopback address with its own port; /etc/hosts names the addresses, so
`scontrol show hostnames` gives names that resolve, as on a real cluster. What is set up here:

* slurm-wlm installed with apt-get where it is missing (root on Debian; else the caller skips);
* slurm.conf and every state, spool, pid and log file under one temporary directory;
* `127.0.0.2 node1` and `127.0.0.3 node2` appended to /etc/hosts (marked, removed afterwards);
* munged (unless one already answers), slurmctld and two slurmd started in the foreground as
  child processes, so each is stopped by its own PID;
* `stop()` cancels the jobs, stops every daemon it started and their children by PID, then any
  process that still carries this cluster's SLURM_CONF (slurmstepd re-parents itself to init, and
  the job tasks run under it), and removes its /etc/hosts lines, also after a failed start. The PIDs and lines are kept in
  `cluster.json` under the directory, so another process can stop the cluster too:

      python -m tests.multinode.cluster start /tmp/finetune-slurm     # prints the SLURM_CONF to export
      python -m tests.multinode.cluster stop /tmp/finetune-slurm

The ports are fixed (16817 controller, 16818 default slurmd, 17001/17002 the nodes): a port in
use is reported, not worked around, since another cluster may be using it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NODES = (("node1", "127.0.0.2", 17001), ("node2", "127.0.0.3", 17002))
CONTROLLER_PORT, SLURMD_PORT = 16817, 16818
HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# finetune multinode tests"
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
# A requeued job waits cred_expire + 1 s before it may start again (120 s by default), and a job
# that became eligible waits for the scheduler's next pass (sched_interval, 60 s by default): both
# short here so the preemption test's requeued job restarts within seconds.
CRED_EXPIRE_S = 5  # the smallest value slurmctld accepts ("cred_expire=2 invalid")
CLIENTS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel", "srun")


class CannotRun(Exception):
    """This machine cannot host the cluster (not root, no apt-get): the tests are skipped with it."""


def install_problem() -> str | None:
    """Why slurm-wlm cannot be installed here, or None (installed, or installable)."""
    if all(os.path.exists(d) for d in DAEMONS) and all(shutil.which(c) for c in CLIENTS):
        return None
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "slurm-wlm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "slurm-wlm is not installed and this machine has no apt-get (Debian/Ubuntu)"
    return None


def ensure_installed(log: Path) -> None:
    """apt-get install slurm-wlm (about 20 s) where it is missing; CannotRun where that cannot work."""
    problem = install_problem()
    if problem:
        raise CannotRun(problem)
    if all(os.path.exists(d) for d in DAEMONS) and all(shutil.which(c) for c in CLIENTS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(log, "a") as out:
        for cmd in (
            ["apt-get", "install", "-y", "-q", "slurm-wlm"],  # a stale package list: update, retry
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "slurm-wlm"],
        ):
            code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600)
            if code == 0 and cmd[1] == "install":
                return
    raise RuntimeError(f"apt-get install slurm-wlm failed; see {log}")


def slurm_conf(root: Path, hostname: str) -> str:
    """The cluster's slurm.conf: keys that work with several slurmd on one host, no cgroups, no systemd."""
    nodes = "\n".join(
        f"NodeName={name} NodeAddr={addr} NodeHostname={hostname} Port={port} CPUs=2 RealMemory=1000 State=UNKNOWN"
        for name, addr, port in NODES
    )
    return f"""\
ClusterName=finetune-tests
SlurmctldHost=localhost
SlurmctldPort={CONTROLLER_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=batch Nodes={",".join(n for n, _, _ in NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


@dataclass
class Cluster:
    root: Path
    conf: Path = None
    started: list = field(default_factory=list)  # (name, psutil.Process) in start order
    hosts_added: list = field(default_factory=list)

    @classmethod
    def attach(cls, root: Path) -> Cluster:
        """The cluster another process started under `root` (its cluster.json), to stop it."""
        state = json.loads((root / "cluster.json").read_text())
        cluster = cls(root, conf=root / "slurm.conf", hosts_added=state["hosts"])
        for name, pid, created in state["daemons"]:
            try:
                proc = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
            if abs(proc.create_time() - created) < 1:  # the same process, not a reused PID
                cluster.started.append((name, proc))
        return cluster

    def _save(self) -> None:
        state = {"daemons": [(n, p.pid, p.create_time()) for n, p in self.started], "hosts": self.hosts_added}
        (self.root / "cluster.json").write_text(json.dumps(state))

    @property
    def env(self) -> dict:
        """The environment every SLURM client command needs (and jobs inherit)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- start ------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> Cluster:
        """Install if needed, configure and start munged, slurmctld and both slurmd; wait until
        `sinfo -N` shows both nodes idle. On any failure everything started is stopped again."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        ensure_installed(self.root / "apt.log")
        busy = [p for p in (CONTROLLER_PORT, SLURMD_PORT, *(p for _, _, p in NODES)) if _port_in_use(p)]
        if busy:
            raise RuntimeError(
                f"ports {busy} are in use on this machine (another SLURM cluster?); the test "
                f"cluster needs {CONTROLLER_PORT}, {SLURMD_PORT} and {[p for *_, p in NODES]}"
            )
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(slurm_conf(self.root, socket.gethostname()))
        self._add_hosts()
        if not self._munge_answers():
            run_dir = Path("/run/munge")
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.chown(run_dir, "munge", "munge")
            self._daemon("munged", ["/usr/sbin/munged", "--foreground"], user="munge")
            self._wait(self._munge_answers, 15, "munged to answer (munge -n | unmunge)")
        self._daemon("slurmctld", ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: self._client(["sinfo", "-h"]).returncode == 0, 20, "slurmctld to answer sinfo")
        for name, _, _ in NODES:
            self._daemon(f"slurmd {name}", ["/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", name])
        self._wait(self.all_idle, timeout, "both nodes idle in sinfo -N")

    def _daemon(self, name: str, cmd: list[str], user: str | None = None) -> None:
        log = open(self.root / f"{name.replace(' ', '-')}.out", "ab")
        popen = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            user=user,
            env={**os.environ, "SLURM_CONF": str(self.conf or "")},
            start_new_session=True,
        )
        log.close()
        self.started.append((name, psutil.Process(popen.pid)))
        self._save()
        time.sleep(0.2)
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited at once with {popen.returncode}: {self.log_tail(name)}")

    def _add_hosts(self) -> None:
        text = HOSTS.read_text()
        lines = [f"{addr} {name} {HOSTS_MARK}" for name, addr, _ in NODES]
        self.hosts_added = lines
        self._save()  # before the write: a stop after a crash in between still removes them
        with open(HOSTS, "a") as f:  # in place: /etc/hosts may be a bind mount
            f.write(("" if text.endswith("\n") or not text else "\n") + "\n".join(lines) + "\n")

    def _munge_answers(self) -> bool:
        if not shutil.which("munge"):
            return False
        p = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True)
        return "STATUS:" in p.stdout and "Success" in p.stdout

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name, proc in self.started:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    raise RuntimeError(f"{name} exited while waiting for {what}: {self.log_tail(name)}")
            time.sleep(0.3)
        raise RuntimeError(
            f"timed out after {timeout} s waiting for {what}; sinfo -N: {self._client(['sinfo', '-N']).stdout}"
        )

    # --- use ---------------------------------------------------------------------------------

    def _client(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**self.env, **kw.pop("env", {})},
            timeout=kw.pop("timeout", 30),
            **kw,
        )

    def node_states(self) -> dict[str, str]:
        out = self._client(["sinfo", "-N", "-h", "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def all_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n, _, _ in NODES)

    def scontrol(self, *args: str) -> str:
        p = self._client(["scontrol", *args])
        if p.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (state, restart count, exit code, ...); {} once gone."""
        p = self._client(["scontrol", "-o", "show", "job", job_id])
        if p.returncode:
            return {}
        return dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)

    def cancel_all(self, timeout: float = 30) -> None:
        if self.conf is None or not any(n.startswith("slurmctld") for n, _ in self.started):
            return
        # SIGKILL first: a plain cancel sends SIGTERM, on which the ranks checkpoint and the job script
        # requeues the job, which would keep the queue busy for a minute
        self._client(["scancel", "--user", "root", "--full", "--signal=KILL"])
        self._client(["scancel", "--user", "root"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._client(["squeue", "-h"]).stdout.strip():
            time.sleep(0.5)

    def log_tail(self, name: str, lines: int = 20) -> str:
        out = []
        for path in (
            self.root / f"{name.replace(' ', '-')}.out",
            self.root / f"{name.split()[0]}.log",
            self.root / f"slurmd-{name.split()[-1]}.log",
        ):
            if path.is_file():
                out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # --- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel the jobs, stop every daemon started here (and what they spawned) by PID, in
        reverse start order, and remove the /etc/hosts lines. Safe to call twice."""
        try:
            self.cancel_all()
        except Exception:  # noqa: BLE001 - stopping must go on whatever the controller says
            pass
        for _, proc in reversed(self.started):
            _stop_tree(proc)
        self.started.clear()
        for proc in self._leftovers():  # slurmstepd re-parents itself to init: not below slurmd
            _stop_tree(proc)
        self._remove_hosts()
        if self.root.is_dir():
            self._save()

    def _leftovers(self) -> list:
        """Processes this cluster spawned that outlived its daemons (slurmstepd re-parents itself to
        init): a slurmstepd holding a log file of this cluster open, and the job tasks, which carry
        this cluster's SLURM_CONF in their environment (slurmstepd clears its own)."""
        if self.conf is None:
            return []
        mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        found = []
        for proc in psutil.process_iter(["name"]):
            try:
                if proc.pid in mine:
                    continue
                if proc.info["name"] == "slurmstepd":
                    ours = any(f.path.startswith(f"{self.root}/") for f in proc.open_files())
                else:
                    ours = proc.environ().get("SLURM_CONF") == str(self.conf)
                if ours:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def _remove_hosts(self) -> None:
        if not self.hosts_added:
            return
        kept = [line for line in HOSTS.read_text().splitlines() if line not in self.hosts_added]
        with open(HOSTS, "r+") as f:
            f.seek(0)
            f.write("\n".join(kept) + "\n")
            f.truncate()
        self.hosts_added = []


def _stop_tree(proc: psutil.Process, grace: float = 10) -> None:
    """SIGTERM the daemon and its descendants (slurmstepd, job tasks), SIGKILL what is left after
    grace; a child of this process is reaped too."""
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "stop":
        Cluster.attach(root).stop()
        print(f"stopped the cluster of {root}")
        return 0
    try:
        cluster = Cluster(root).start()
    except CannotRun as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"two-node cluster up: {cluster.node_states()}\n    export SLURM_CONF={cluster.conf}\n"
        f"stop it with: python -m tests.multinode.cluster stop {root}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
