"""A throwaway Slurm cluster on this machine, for tests/slurm/check_multinode.py (`make test-slurm`).

Debian 12's Slurm 22.05 is built with multiple-slurmd support (`scontrol show config`: MULTIPLE_SLURMD = Yes), so
several `slurmd -N NAME`, each with its own port, are several nodes on one host. Each declares GPUs as generic
resources backed by character devices made here (`mknod c 1 3`, /dev/null's numbers): Slurm 22.05 drops a GPU gres
without File= ("Removing file-less GPU") and the node goes INVAL. There is no slurmdbd, so no
AccountingStorageTRES=gres/gpu (it stops slurmctld without one). munged listens on its own socket; configuration,
state, spool and logs live in one temporary directory; every address is a loopback address given as a number (no
name lookup), and clients find the cluster through SLURM_CONF (without it they look for DNS SRV records). The daemons
run in the foreground as children of this process and stop() ends them by PID, slurmds first: a slurmd that cannot
reach slurmctld ignores SIGTERM (it gets SIGKILL after a grace). Job processes left behind by a failed test are found
by the SLURM_CONF in their environment and killed by PID.
"""
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """`nodes`: node name -> NodeAddr; `partitions`: name -> node names (the first is the default partition)."""

    def __init__(self, root, nodes, partitions, gpus_per_node=2, kill_wait=10):
        self.root = Path(root)
        self.nodes, self.partitions = nodes, partitions
        self.gpus_per_node, self.kill_wait = gpus_per_node, kill_wait
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons = []  # (name, Popen), in start order

    # --- set-up --------------------------------------------------------------------------------
    def write_config(self):
        root = self.root
        for d in ("state", "spool", "log", "dev", "munge"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        devices = []
        for i in range(len(self.nodes) * self.gpus_per_node):
            dev = root / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
            devices.append(dev)
        ports = [free_port() for _ in range(1 + len(self.nodes))]
        cpus = os.cpu_count()
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={addr} Port={ports[1 + i]} CPUs={cpus} RealMemory=1000 "
            f"Gres=gpu:{self.gpus_per_node} State=UNKNOWN" for i, (n, addr) in enumerate(self.nodes.items()))
        partition_lines = "\n".join(
            f"PartitionName={name} Nodes={','.join(nodes)} Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE "
            "State=UP" for i, (name, nodes) in enumerate(self.partitions.items()))
        self.conf.write_text(f"""\
ClusterName=testcluster
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire (120 s by default) is also how long a requeued job waits before it can start again
AuthInfo=socket={root}/munge/socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
MailProg=/bin/true
# linuxproc signals every process of a step, as proctrack/cgroup does, without a cgroup set-up
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# every 2 s instead of 60 / 30: a requeued job starts as soon as it may
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
KillWait={self.kill_wait}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{node_lines}
{partition_lines}
""")
        per_node = [devices[i * self.gpus_per_node:(i + 1) * self.gpus_per_node] for i in range(len(self.nodes))]
        (root / "gres.conf").write_text("".join(
            f"NodeName={n} Name=gpu File={','.join(map(str, devs))}\n" for n, devs in zip(self.nodes, per_node)))

    def start(self, timeout=60):
        self.write_config()
        munge = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={munge}/socket",
                               f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self._wait(lambda: (munge / "socket").exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            self._spawn(f"slurmd {node}", ["slurmd", "-D", "-N", node])
        self._wait(lambda: self.node_states() == {n: "idle" for n in self.nodes}, timeout, "both nodes idle")

    def _spawn(self, name, cmd):
        log = open(self.root / "log" / f"{name.replace(' ', '-')}.console", "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.daemons.append((name, proc))

    def _wait(self, predicate, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            dead = [(name, p.returncode) for name, p in self.daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}\n{self.logs()}")
            if predicate():
                return
            time.sleep(0.5)
        raise TimeoutError(f"no {what} after {timeout} s\n{self.logs()}")

    def logs(self, lines=15):
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # --- clients -------------------------------------------------------------------------------
    def run(self, *cmd, check=True, env=None, timeout=60):
        return subprocess.run(list(map(str, cmd)), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              check=check, timeout=timeout)

    def node_states(self):
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    # --- tear-down -----------------------------------------------------------------------------
    def stop(self):
        """Cancel every job, stop the daemons (by PID, slurmds first), kill what jobs left behind (by PID)."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self.daemons):
            self.run("scancel", "--user", str(os.getuid()), check=False)
            deadline = time.time() + self.kill_wait + 20
            while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
        for name, proc in sorted(self.daemons, key=lambda d: not d[0].startswith("slurmd")):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in self.leftover_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftover_processes(self):
        """Processes started for this cluster (slurmstepd, job scripts, training processes): SLURM_CONF is ours."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mark in environ.read_bytes().split(b"\0") and int(environ.parent.name) != os.getpid():
                    found.append(int(environ.parent.name))
            except OSError:
                continue
        return found


def slurm_installed():
    return all(shutil.which(d) for d in DAEMONS) and shutil.which("sbatch") is not None
