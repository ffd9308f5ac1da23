"""slurm/multinode.sbatch on a real Slurm (`make test-slurm`: root, Debian's Slurm 22.05, installed by the Makefile).

A throwaway cluster on this machine (slurm_cluster.py): nodes n1 and n2 at 127.0.0.1 (and n3, "another host" at
127.0.0.2), each with 2 GPUs declared as generic resources; the training command is the tiny CPU BERT run, on 2 nodes x
1 process (CPU=1: --cpu, gloo):
- the GPUs Slurm gives a job become the processes per node (DRY_RUN=1 prints each node's launch command and devices);
- a rendezvous address that another node cannot reach stops the job with one line;
- an uninterrupted run finishes with exit status 0: the reference;
- one run of the same command, stopped three times and continued: `scancel --signal=TERM` during start-up, then a
  resubmission that resumes by itself and is stopped by the time limit's --signal, requeued by REQUEUE=1, stopped
  again by `scancel --signal=TERM` mid-training, requeued, and finished. Every stop ends the job run with exit status
  0 and "stopped cleanly at step N, resumable" with checkpoints/step_N, every resume starts at step N, metrics.jsonl
  never repeats a step and matches the reference's, and the exported model is bitwise the reference's;
- submitting the finished run again does nothing;
- a ResNet run with DataLoader workers (-j 2), whose every process the time limit's --signal reaches (cgroup
  process tracking), saves, ends with exit status 0 and "stopped cleanly at step N, resumable", and the same command
  submitted again resumes from step N and finishes.
The file name does not start with test_, so `make test` does not collect it.
"""
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import ENV, ROOT, assert_same_weights, read_json, read_jsonl
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, free_port, slurm_installed

from utils.demo_data import write_digits_imagefolder, write_text_classification_data

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
TRAIN_LINE = r"^epoch \d+ step (\d+)/"
LIMIT = 30  # minutes: the time limit of the job that is stopped by its time limit, until the test cuts it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.getuid() != 0 or not slurm_installed():
        pytest.fail("needs root and Debian's slurmctld, slurmd, slurm-client and munge: run `make test-slurm`")
    # n1 and n2 share 127.0.0.1, as two nodes of one network; n3 is "another host" at 127.0.0.2, only in partition
    # `far`, where the first node's loopback address is not one that n3 reaches.
    cluster = SlurmCluster(tmp_path_factory.mktemp("cluster"),
                           nodes={"n1": "127.0.0.1", "n2": "127.0.0.1", "n3": "127.0.0.2"},
                           partitions={"debug": ["n1", "n2"], "far": ["n1", "n3"]})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32,000 headlines: 1,000 steps per epoch at the default global batch of 32, 4 epochs in about a minute here,
    long enough that a run still trains 30 s after its time limit is cut (see test_stops_save_and_resume_exactly)."""
    return write_text_classification_data(tmp_path_factory.mktemp("data"), n_train=32000, n_val=100, n_test=100)


def bert_command(data, output_dir):
    return ["train_bert_cls.py", "--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch",
            "--config_overrides", "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512",
            "--max_seq_len", 64, "--learning_rate", 2e-3, "--num_train_epochs", 4, "--do_train", "--do_eval",
            "--do_test", "--logging_steps", 10, "--checkpointing_steps", 200, "--output_dir", output_dir]


def submit(cluster, command, sbatch_opts=(), env=None, wait=False):
    """sbatch slurm/multinode.sbatch COMMAND from the repository root, with this Python environment on PATH;
    returns (job id, its log file)."""
    logs = cluster.root / "jobs"
    logs.mkdir(exist_ok=True)
    job_env = {**ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "CPU": "1", "MAIN_PORT": str(free_port()), **(env or {})}
    proc = cluster.run("sbatch", "--parsable", "--chdir", ROOT, "--output", logs / "slurm-%j.out", *sbatch_opts,
                       "slurm/multinode.sbatch", *command, env=job_env, check=False)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    job_id, log = proc.stdout.split(";")[0].strip(), logs / f"slurm-{proc.stdout.split(';')[0].strip()}.out"
    if wait:  # polled here: `sbatch --wait` polls at growing intervals, up to 10 s late
        wait_job(cluster, job_id, log)
    return job_id, log


def log_text(path):
    return path.read_text(errors="replace") if path.exists() else ""


# The time-outs are for a machine shared with other work: at a load of 11 on 2 cores the reference run took 7 minutes.
def wait_job(cluster, job_id, log, timeout=1200):
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = cluster.job(job_id)
        if job["JobState"] in ENDED:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout} s\n{log_text(log)[-4000:]}")


def wait_line(cluster, job_id, log, pattern, start=0, timeout=600):
    """The first match of `pattern` (a line) in the job's log after offset `start`; fails if the job ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.compile(pattern, re.M).search(log_text(log), start)
        if match:
            return match
        if cluster.job(job_id)["JobState"] in ENDED:
            break
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: no line {pattern!r}\n{log_text(log)[start:][-6000:]}\n{cluster.logs()}")


def stopped_at(cluster, job_id, log, start):
    """After a stop: the step of "stopped cleanly at step N, resumable", whose checkpoint must exist."""
    match = wait_line(cluster, job_id, log, r"^stopped cleanly at step (\d+), resumable$", start)
    return int(match.group(1)), match.end()


def restarted(cluster, job_id, log, start, restarts):
    """The requeued job runs again (after the cluster's cred_expire), with its long time limit back."""
    wait_line(cluster, job_id, log, r"^requeueing: ", start)
    deadline, limit_restored = time.time() + 300, False
    while time.time() < deadline:
        job = cluster.job(job_id)
        if job["JobState"] == "PENDING" and not limit_restored:
            cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={LIMIT}")
            limit_restored = True
        if job["JobState"] == "RUNNING" and int(job["Restarts"]) == restarts:
            assert limit_restored, job
            return
        assert job["JobState"] not in ENDED, job
        time.sleep(0.5)
    raise AssertionError(f"requeued job {job_id} did not start again: {cluster.job(job_id)}")


def assert_same_run(reference, resumed, stops):
    """metrics.jsonl of a run stopped at `stops` and resumed: the reference's events at the same steps, no step
    repeated, the same values; the log line after a stop covers only the steps since the resume, so its loss differs."""
    expected, got = read_jsonl(reference / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    train_steps = [e["step"] for e in got if e["event"] == "train"]
    assert train_steps == sorted(set(train_steps)), "metrics.jsonl repeats a step"
    assert [(e["event"], e["step"]) for e in got] == [(e["event"], e["step"]) for e in expected]
    partial = {min(e["step"] for e in expected if e["event"] == "train" and e["step"] > stop) for stop in stops}
    keys = ("loss", "lr", "accuracy", "macro_f1", "samples")
    for want, have in zip(expected, got):
        if want["event"] == "train" and want["step"] in partial:
            continue
        assert {k: want.get(k) for k in keys} == {k: have.get(k) for k in keys}, (want, have)


@pytest.mark.parametrize("sbatch_opts, env, processes, per_node, devices", [
    ([], {"CPU": "0"}, 4, 2, "0,1"),  # --exclusive: every GPU of the node
    (["--gpus-per-node=1"], {"CPU": "0"}, 2, 1, "0"),
    (["--gpus-per-node=1"], {"CPU": "0", "GPUS_PER_NODE": "0"}, 2, 1, None),  # no GPUs: the CPU
])
def test_gpus_given_become_processes(cluster, tmp_path, sbatch_opts, env, processes, per_node, devices):
    job_id, log = submit(cluster, bert_command(tmp_path, tmp_path / "out"), sbatch_opts,
                         env={"DRY_RUN": "1", **env}, wait=True)
    text = log_text(log)
    assert cluster.job(job_id)["ExitCode"] == "0:0", text
    assert f"{processes} processes, {per_node} on each of 2 nodes" in text, text
    nodes = re.findall(r"^node (\d) \(\S+\): CUDA_VISIBLE_DEVICES=(\S*) .*--num_processes (\d+) ", text, re.M)
    assert sorted(n for n, _, _ in nodes) == ["0", "1"], text
    assert {int(total) for _, _, total in nodes} == {processes}
    if devices is None:
        assert "on the CPU" in text and " --cpu" in text
    else:
        assert {cvd for _, cvd, _ in nodes} == {devices} and " --cpu" not in text


def test_rendezvous_address_every_node_reaches(cluster, tmp_path):
    """n1's address, 127.0.0.1, is loopback, and n3 is elsewhere (127.0.0.2): one line, exit 2, instead of a
    rendezvous that retries forever; MAIN_ADDR overrides the address."""
    command = bert_command(tmp_path, tmp_path / "out")
    job_id, log = submit(cluster, command, ["--partition=far"], env={"DRY_RUN": "1"}, wait=True)
    assert cluster.job(job_id)["ExitCode"] == "2:0"
    assert log_text(log).strip() == ("error: n1's address 127.0.0.1 is a loopback address, which node n3 (at "
                                     "127.0.0.2) cannot reach; set MAIN_ADDR=<an address of n1 that every node reaches>")
    job_id, log = submit(cluster, command, ["--partition=far"], env={"DRY_RUN": "1", "MAIN_ADDR": "127.0.0.1"},
                         wait=True)
    assert cluster.job(job_id)["ExitCode"] == "0:0", log_text(log)
    assert "rendezvous 127.0.0.1:" in log_text(log)


@pytest.fixture(scope="module")
def reference(cluster, data, tmp_path_factory):
    """The run without interruption: 2 nodes x 1 process, to the end, exit status 0."""
    out = tmp_path_factory.mktemp("reference") / "run"
    job_id, log = submit(cluster, bert_command(data, out), wait=True)
    job, text = cluster.job(job_id), log_text(log)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "2 processes, 1 on each of 2 nodes" in text and text.rstrip().endswith("\nfinished"), text
    results = read_json(out / "all_results.json")
    assert (results["num_processes"], results["distributed_type"]) == (2, "MULTI_CPU")
    assert "preempted" not in results
    return out


def test_two_nodes_finish(cluster, reference):
    assert read_json(reference / "all_results.json")["train_steps"] == 4000


def test_stops_save_and_resume_exactly(cluster, data, reference, tmp_path):
    out = tmp_path / "run"
    command = bert_command(data, out)

    # 1. `scancel --signal=TERM` while the processes start: they catch the signal from their first step on and stop
    #    there with a checkpoint; nothing was trained before, so nothing is lost.
    job_id, log = submit(cluster, command)
    deadline = time.time() + 60
    while "StepId" not in cluster.run("scontrol", "show", "step", f"{job_id}.0", check=False).stdout:
        assert time.time() < deadline and cluster.job(job_id)["JobState"] not in ENDED, log_text(log)
        time.sleep(0.2)
    time.sleep(1)
    cluster.run("scancel", "--signal=TERM", job_id)
    step, _ = stopped_at(cluster, job_id, log, 0)
    job, text = wait_job(cluster, job_id, log), log_text(log)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert text.index("SIGTERM, forwarded") < text.index("***** Running training"), "the signal came after start-up"
    assert step > 0 and (out / "checkpoints" / f"step_{step}").is_dir()
    assert read_json(out / "all_results.json")["preempted"] is True
    stops = [step]

    # 2. The same command again, with REQUEUE=1: it resumes by itself. Once it trains, its time limit is cut to end
    #    2 to 3 minutes from now, so that --signal=TERM@170 is due at once: slurmctld sends it at its next time-limit
    #    check (at most 30 s later), mid-training, at least 89 s before the limit.
    job_id, log = submit(cluster, command, [f"--time={LIMIT}", "--signal=TERM@170"], env={"REQUEUE": "1"})
    start = 0
    for stop_with in ("time limit", "scancel"):
        resumed = wait_line(cluster, job_id, log, rf"^Resumed from \S+/step_{stops[-1]} at step {stops[-1]}$", start)
        wait_line(cluster, job_id, log, TRAIN_LINE, resumed.end())
        if stop_with == "time limit":
            hours, minutes, seconds = map(int, cluster.job(job_id)["RunTime"].split("-")[-1].split(":"))
            cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={hours * 60 + minutes + 1 + 2}")
        else:
            cluster.run("scancel", "--signal=TERM", job_id)
        step, start = stopped_at(cluster, job_id, log, resumed.end())
        assert step > stops[-1] and (out / "checkpoints" / f"step_{step}").is_dir(), (stop_with, step, stops)
        stops.append(step)
        restarted(cluster, job_id, log, start, restarts=len(stops) - 1)

    # 3. The second requeued run resumes from the last stop and finishes; the job ends with status 0.
    wait_line(cluster, job_id, log, rf"^Resumed from \S+/step_{stops[-1]} at step {stops[-1]}$", start)
    job, text = wait_job(cluster, job_id, log), log_text(log)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "2"), text
    assert text.rstrip().endswith("\nfinished"), text[-3000:]
    assert len(re.findall(r"^stopped cleanly at step", text, re.M)) == 2

    assert_same_run(reference, out, stops)
    assert_same_weights(load_file(reference / "best_model" / "model.safetensors"),
                        load_file(out / "best_model" / "model.safetensors"))
    want, have = read_json(reference / "all_results.json"), read_json(out / "all_results.json")
    assert {k: v for k, v in have.items() if k.startswith("test_")} == \
        {k: v for k, v in want.items() if k.startswith("test_")}

    # 4. Submitted once more, the finished run is left alone.
    job_id, log = submit(cluster, command, wait=True)
    assert cluster.job(job_id)["ExitCode"] == "0:0"
    assert "holds a finished run (all_results.json): nothing to do" in log_text(log)


def resnet_command(data, output_dir):
    """train_resnet.py on the 16x16 digits with 2 loader workers per process: 21 steps per epoch, a few minutes."""
    return ["train_resnet.py", data, "--arch", "resnet18", "--image_size", 16, "--val_resize", 16, "-b", 64,
            "--lr", 0.02, "--momentum", 0, "-j", 2, "-p", 5, "--epochs", 12, "--output_dir", output_dir]


def test_resnet_with_loader_workers_stopped_by_the_time_limit_saves_and_resumes(cluster, tmp_path):
    data, out = write_digits_imagefolder(tmp_path / "digits", size=16), tmp_path / "run"
    command = resnet_command(data, out)
    job_id, log = submit(cluster, command, [f"--time={LIMIT}", "--signal=TERM@170"])
    wait_line(cluster, job_id, log, r"^Epoch: \[1\]")  # training, with its loader workers
    hours, minutes, seconds = map(int, cluster.job(job_id)["RunTime"].split("-")[-1].split(":"))
    cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={hours * 60 + minutes + 1 + 2}")
    step, _ = stopped_at(cluster, job_id, log, 0)
    job, text = wait_job(cluster, job_id, log), log_text(log)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "killed by signal" not in text and (out / "checkpoints" / f"step_{step}").is_dir(), text[-3000:]

    job_id, log = submit(cluster, command, wait=True)
    job, text = cluster.job(job_id), log_text(log)
    assert re.search(rf"^Resumed from \S+/step_{step} at step {step}$", text, re.M), text[-3000:]
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0") and text.rstrip().endswith("\nfinished"), text
    assert read_json(out / "all_results.json")["train_steps"] == 12 * (1348 // 64)
