"""A one-node Slurm cluster on localhost for tests (Debian's slurm-wlm and munge).

munged, slurmctld and slurmd run in the foreground, children of the test, from a
configuration written to a temporary directory that also holds their munge key, state,
spool, logs and pid files; the ports are free ones, so the cluster collides with no other
(nor with a system Slurm). No GPUs: 2 CPUs, no gres. Every process of the cluster, the
daemons, slurmstepd and the jobs' processes, carries SLURM_CONF=<this configuration> in
its environment: `stop()` cancels the jobs, ends the daemons, kills whatever still carries
that mark and removes the directory, whatever happened before.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SBIN_PATH = "/usr/sbin:/sbin"  # where Debian puts the daemons
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
NODE = "localhost"
# A job step's credential lifetime; also how long a requeued job waits before it can start
# again, so that no launch of its previous run is still accepted (Slurm's default: 120 s).
CRED_EXPIRE_S = 5


class ClusterUnavailable(Exception):
    """Slurm cannot run here (the reason names what is missing or what failed)."""


def unavailable() -> str | None:
    """Why no test cluster can be started on this machine, or None."""
    if os.geteuid() != 0:
        return "not root: the test's slurmctld, slurmd and munged run as root"
    path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=path) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    return None


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now, below the kernel's ephemeral range: a
    port chosen now is bound by a daemon or torchrun seconds later, and meanwhile no other
    process's connection or bind(0) is handed it (an ephemeral one was, on a busy machine:
    torchrun then found its rendezvous port taken and waited 60 s as a client)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    candidates = random.sample(range(max(1024, ephemeral_low // 2), ephemeral_low), 200)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise OSError(f"no {count} free ports below {ephemeral_low}")
    finally:
        for s in sockets:
            s.close()


def _config(directory: str, socket_path: str, ctld_port: int, slurmd_port: int) -> str:
    host = socket.gethostname().split(".")[0]  # slurmctld runs only where its host is named
    return f"""\
ClusterName=sysxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={directory}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# A requeued job becomes eligible when its delay (cred_expire) ends, an event that starts no
# scheduling: the periodic pass does, every 60 s by default.
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=2
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Start with `start()` (raises ClusterUnavailable), end with `stop()` (always)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="slurm-test-")
        self.conf = os.path.join(self.directory, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf,
                    "PATH": f"{os.environ.get('PATH', '')}:{SBIN_PATH}"}
        self._daemons: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float = 30.0) -> None:
        d = self.directory
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(d, sub), mode=0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))  # this cluster's own key: no other munged can vouch for it
        socket_path = os.path.join(d, "munge", "munge.socket")
        ctld_port, slurmd_port = free_ports(2)
        with open(self.conf, "w") as f:
            f.write(_config(d, socket_path, ctld_port, slurmd_port))
        open(os.path.join(d, "plugstack.conf"), "w").close()  # not /etc/slurm's plugins
        self._spawn("munged", "munged", "--foreground", "--force", f"--key-file={key}",
                    f"--socket={socket_path}", f"--pid-file={d}/munge/munged.pid",
                    f"--log-file={d}/munged.log", f"--seed-file={d}/munge/seed")
        self._wait_for(lambda: os.path.exists(socket_path), timeout, "munged's socket")
        self._spawn("slurmctld", "slurmctld", "-D")
        self._spawn("slurmd", "slurmd", "-D", "-N", NODE)
        self._wait_for(lambda: self._node_state() == "idle", timeout, "the node to be idle")

    def _spawn(self, name: str, *cmd: str) -> None:
        log = open(os.path.join(self.directory, f"{name}.out"), "w")  # noqa: SIM115
        try:
            self._daemons[name] = subprocess.Popen(cmd, env=self.env, stdout=log,
                                                   stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL)
        finally:
            log.close()  # the child holds its own descriptor

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self._daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no {what} in {timeout:.0f} s"
                raise ClusterUnavailable(f"the test Slurm cluster did not start ({why}):\n"
                                         + self.logs())
            time.sleep(0.2)

    def _node_state(self) -> str:
        result = subprocess.run(["sinfo", "-h", "-n", NODE, "-o", "%T"], env=self.env,
                                capture_output=True, text=True, timeout=10)
        return result.stdout.strip() if result.returncode == 0 else ""

    def logs(self, lines: int = 30) -> str:
        """The last lines of every daemon's log, for failure messages."""
        parts = []
        for root, _, files in os.walk(self.directory):
            for name in sorted(files):
                # a daemon's stderr (.out) repeats its log file, where it got to open one
                if name.endswith(".log") or (name.endswith(".out")
                                             and name[:-4] + ".log" not in files):
                    with open(os.path.join(root, name), errors="replace") as f:
                        tail = f.readlines()[-lines:]
                    parts.append(f"--- {name}\n{''.join(tail)}")
        return "\n".join(parts)

    def run(self, *cmd: str, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (`env`: added to the cluster's)."""
        result = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True,
                                text=True, timeout=30)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}: "
                                 f"{result.stderr.strip()}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """The fields of `scontrol show job` that tests read (JobState, Reason, Restarts,
        ExitCode); values never hold spaces."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return {key: value for key, value in re.findall(
            r"\b(JobState|Reason|Restarts|ExitCode)=(\S+)", text)}

    def processes(self) -> list[int]:
        """Every process that carries this cluster's mark (the daemons included)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone, a zombie, or not ours to read
                pass
        return found

    def stop(self) -> None:
        """Cancel every job, end the daemons and every process of the cluster, remove the
        directory. Safe to call after a failed or partial start."""
        try:
            if self._daemons.get("slurmctld") and self._daemons["slurmctld"].poll() is None:
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    self._until(lambda: not self.run("squeue", "-h", check=False).stdout
                                and not self._steps(), 20.0)
            for name in ("slurmd", "slurmctld", "munged"):
                daemon = self._daemons.get(name)
                if daemon is not None and daemon.poll() is None:
                    daemon.terminate()
                    try:
                        daemon.wait(10)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait()
            for pid in self.processes():  # a step or job process the cancellation missed
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._until(lambda: not self.processes(), 10.0)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _steps(self) -> list[int]:
        steps = []
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "slurmstepd":
                        steps.append(pid)
            except OSError:
                pass
        return steps

    @staticmethod
    def _until(done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            time.sleep(0.2)
