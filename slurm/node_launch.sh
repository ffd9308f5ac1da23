#!/bin/bash
# One node's part of slurm/multinode.sbatch: `srun` runs this once per node. It runs this node's
# `accelerate launch` (machine rank = $SLURM_NODEID), which starts the node's training processes, and
# handles the stop signal so that a clean stop ends with exit status 0:
#
#   bash slurm/node_launch.sh STOP_MARK ACCELERATE_LAUNCH_ARGS...
#
# Slurm stops a job early (the --signal before the time limit, `scancel --signal=TERM JOBID`) with
# SIGTERM to the processes of its steps: with ProctrackType cgroup or linuxproc to every process here
# (this shell, the launcher, the training processes); with pgid only to this shell and the launcher.
# The training processes save a checkpoint on SIGTERM and exit 0. The launcher (torch's elastic
# agent) would, on SIGTERM, stop them itself and then exit 1 even when all of them saved and exited
# 0, and srun --kill-on-bad-exit would end the other nodes in the middle of their work. So:
#   - the launcher runs with SIGTERM ignored and not handled (torchrun's --signals_to_handle, read
#     from PET_SIGNALS_TO_HANDLE): its exit status stays its training processes' own (0 after a clean
#     stop or a finished run, non-zero when one failed);
#   - this shell forwards SIGTERM to the training processes (the launcher's children), to each one
#     once, as soon as it no longer ignores SIGTERM: they inherit the ignored SIGTERM from the
#     launcher and catch it from the start of their training loop on, so a signal that comes during
#     start-up stops the run within a second of training, with a checkpoint, instead of being lost.
#     Once only: an exiting Python process restores SIGTERM's default action, and a second one would
#     kill it (exit -15 after a good save);
#   - on the first SIGTERM it creates the file STOP_MARK (where that directory exists: on the
#     batch script's node), so the batch script can tell a stopped run from a finished one.
# DRY_RUN=1 prints what each node would run (with its GPUs and CPUs) instead of running it.
set -uo pipefail

stop_mark=$1
shift
launch=(accelerate launch --machine_rank "$SLURM_NODEID" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "node $SLURM_NODEID ($(hostname)): CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-}" \
         "CPUs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" \
         "OMP_NUM_THREADS=${OMP_NUM_THREADS-}: ${launch[*]}"
    exit 0
fi

stopping=0
launcher=""
declare -A forwarded=()
forward_term() {
    local pid ignored
    [ -n "$launcher" ] || return 0
    for pid in $(ps -o pid= --ppid "$launcher" 2>/dev/null); do
        [ -z "${forwarded[$pid]:-}" ] || continue
        ignored=$(awk '/^SigIgn:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
        [ -n "$ignored" ] || continue
        (( (16#$ignored >> 14 & 1) == 0 )) || continue  # bit 14 set = SIGTERM (15) still ignored
        kill -TERM "$pid" 2>/dev/null
        forwarded[$pid]=1
    done
}
on_term() {
    if [ "$stopping" = 0 ]; then
        stopping=1
        echo "$(date '+%F %T') node $SLURM_NODEID: SIGTERM, forwarded to the training processes" >&2
        [ -d "$(dirname "$stop_mark")" ] && : > "$stop_mark"
    fi
    forward_term
}
trap on_term TERM

( trap '' TERM; PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT exec "${launch[@]}" ) &
launcher=$!

# Waits in 1 s steps on a pipe that never delivers (no `sleep` process for the signal to hit).
exec {tick}<> <(:)
# bash reaps the launcher as soon as it exits, so `kill -0` fails from then on; `wait` gives its status.
while kill -0 "$launcher" 2>/dev/null; do
    [ "$stopping" = 1 ] && forward_term
    read -r -t 1 -u "$tick" || true
done
wait "$launcher"
