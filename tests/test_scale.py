"""What grows with the number of processes: the stop agreement (one all-reduce in flight about once a second, read
by every rank at the same check), the open files a launch needs (checked before any process group opens), and the
process counts a checkpoint can continue on. The 8-process runs of both scripts are in test_eight_processes.py."""
import json
import resource
import subprocess
import sys
import textwrap
import types

import pytest
from conftest import FAKE_GPU, HANG_S, ROOT, TORCHRUN, free_port, launch_cmd, run

from utils.checkpoint import check_global_batches, resumable_process_counts
from utils.loop import MAX_CHECKS_PER_AGREEMENT
from utils.runtime import UserError, open_files_needed

SIGNAL_AT = 30  # the check before which rank 2 receives SIGTERM

RANK = textwrap.dedent(f"""
    import datetime, json, os, signal, sys, time, types
    sys.path.insert(0, {str(ROOT)!r})
    import torch.distributed as dist
    from utils.loop import PreemptionGuard
    from utils.runtime import HostChannel
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    accelerator = types.SimpleNamespace(num_processes=dist.get_world_size(), gradient_accumulation_steps=1,
                                        print=print)
    HostChannel.open(accelerator, datetime.timedelta(seconds=120))
    guard, record = PreemptionGuard(accelerator), {{"rank": rank, "every": [], "stopped_at": None}}
    for check in range(1, 1000):
        time.sleep(0.002)  # a short step: the cadence stretches to its longest
        if rank == 2 and check == {SIGNAL_AT}:
            os.kill(os.getpid(), signal.SIGTERM)
        if guard.should_stop(check):
            record["stopped_at"] = check
            break
        record["every"].append(guard.every)
    guard.close(preempted=True)
    with open(os.path.join(sys.argv[1], f"rank{{rank}}.json"), "w") as out:  # one file each: no interleaved lines
        json.dump(record, out)
""")


def test_four_ranks_agree_on_one_stop_check_a_signal_to_one_of_them(tmp_path):
    """Rank 2 alone is signalled; every rank stops at the same check, after the signal and within two agreements,
    having read the same cadence at every check (each agreement carries the slowest rank's seconds per check)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = run([*TORCHRUN, "--nproc_per_node", "4", "--master_addr", "127.0.0.1", "--master_port", free_port(),
                script, tmp_path], timeout=HANG_S)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)
               if (tmp_path / f"rank{rank}.json").exists()]
    assert [record["rank"] for record in records] == [0, 1, 2, 3], proc.stdout[-3000:] + proc.stderr[-3000:]
    stops = {record["stopped_at"] for record in records}
    assert len(stops) == 1 and SIGNAL_AT < stops.pop() <= SIGNAL_AT + 2 * MAX_CHECKS_PER_AGREEMENT + 1, records
    assert all(record["every"] == records[0]["every"] for record in records)
    assert max(records[0]["every"]) > 1  # the agreements did not run at every check


def test_open_files_grow_with_the_processes_as_two_full_meshes_on_the_cpu():
    """A gloo group is a full mesh: at 1,024 processes the training group and the host channel alone pass the soft
    limit of 1,024 many systems ship; NCCL's training group is a budget that does not grow with the processes."""
    one = open_files_needed(1, gpu=False, loader_workers=0, open_now=10)
    assert open_files_needed(1024, gpu=False, loader_workers=0, open_now=10) - one > 2 * 1024
    grow = open_files_needed(2048, gpu=True, loader_workers=0, open_now=10) - open_files_needed(
        1024, gpu=True, loader_workers=0, open_now=10)
    assert grow == 1024  # the host channel's mesh only
    assert open_files_needed(2, gpu=False, loader_workers=8, open_now=10) > open_files_needed(
        2, gpu=False, loader_workers=0, open_now=10)


def test_a_launch_under_too_low_a_hard_limit_on_open_files_stops_in_one_line(text_data, tmp_path):
    """`ulimit -n 40` (soft and hard): each rank stops before any process group opens, in one line naming ulimit -n
    and the number it needs; nothing is written."""
    out = tmp_path / "out"
    cmd = launch_cmd("train_bert_cls.py", ["--data_dir", text_data, "--model_name_or_path", text_data / "model",
                                           "--from_scratch", "--do_train", "--output_dir", out], num_processes=2)
    proc = run(["prlimit", "--nofile=40:40", *cmd], check=False, env=FAKE_GPU)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: open files:")]
    assert proc.returncode != 0 and errors, proc.stderr[-3000:]
    assert "each rank of this 2-process launch may hold about" in errors[0] and "the limit here is 40" in errors[0]
    assert "`ulimit -n " in errors[0] and "Traceback" not in "\n".join(
        line for line in proc.stderr.splitlines() if "train_bert_cls.py" in line)
    assert not out.exists()


def test_raising_the_soft_limit_needs_no_launch(tmp_path):
    """The soft limit is raised up to the hard one, in one line; it is left alone when it suffices."""
    code = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from utils.runtime import check_open_file_limit
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
        check_open_file_limit(80)
        check_open_file_limit(300)
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    lines = proc.stdout.splitlines()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = 600 if hard == resource.RLIM_INFINITY else min(600, hard)
    assert lines == [f"open files: raised the soft limit (ulimit -n) from 100 to {raised} (hard limit "
                     f"{'unlimited' if hard == resource.RLIM_INFINITY else f'{hard:,}'}): each rank of this launch "
                     "may hold about 300 at once", f"soft {raised}"], proc.stdout + proc.stderr


def accelerator_of(processes):
    return types.SimpleNamespace(num_processes=processes)


def checkpoint_with(tmp_path, **saved):
    path = tmp_path / "checkpoints" / "step_48"
    path.mkdir(parents=True)
    (path / "training_state.json").write_text(json.dumps(saved))
    return path


def test_a_fresh_run_on_a_count_that_does_not_divide_its_batches_gets_sizes_that_would():
    assert check_global_batches(accelerator_of(4), {"--train_batch_size": 32, "--eval_batch_size": 64}) == 8
    with pytest.raises(UserError, match=r"^--train_batch_size 32 and --eval_batch_size 64 are GLOBAL batches and must "
                                        r"divide evenly over 3 processes \(try 30 and 63\)$"):
        check_global_batches(accelerator_of(3), {"--train_batch_size": 32, "--eval_batch_size": 64})


def test_a_resume_lists_the_process_counts_that_can_continue_it(tmp_path):
    path = checkpoint_with(tmp_path, **{"--train_batch_size": 32})
    batches = {"--train_batch_size": 32, "--eval_batch_size": 64}
    with pytest.raises(UserError) as refused:
        check_global_batches(accelerator_of(3), batches, path)
    assert str(refused.value) == (f"{path} cannot continue on 3 processes: --train_batch_size 32 and "
                                  "--eval_batch_size 64 must divide evenly over them (GLOBAL batches; "
                                  "--train_batch_size 32 is kept on a resume); it can continue on 1, 2, 4, 8, 16 or 32 "
                                  "processes")
    with pytest.raises(UserError, match=r"it can continue on 1, 2 or 4 processes, or on 8 with --eval_batch_size 16$"):
        check_global_batches(accelerator_of(8), {"--train_batch_size": 32, "--eval_batch_size": 20}, path)
    with pytest.raises(UserError, match=r"^--train_batch_size 30: .* was trained with --train_batch_size 32, which a "
                                        r"resume keeps; resume with --train_batch_size 32, on 1, 2 or 4 processes$"):
        check_global_batches(accelerator_of(3), {"--train_batch_size": 30, "--eval_batch_size": 60}, path)
    resnet = checkpoint_with(tmp_path / "resnet", global_batch_size=256)
    assert check_global_batches(accelerator_of(8), {"-b": 256}, resnet, saved_as="global_batch_size") == 32
    assert resumable_process_counts(12) == "1, 2, 3, 4, 6 or 12 (the divisors of the GLOBAL batch 12)"
