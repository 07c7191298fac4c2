#!/usr/bin/env bash
# Per-host entry of every launch target (srun task, TPU VM worker, XPK container, local run): appends this
# process's output to a per-host log file, mirrors it to stdout, and exits with the command's exit code.
# Usage: host_wrapper.sh LOG_DIR -- COMMAND [ARGS...]
# Log file: LOG_DIR/<short hostname>-p<rank>.log, rank = SLURM_PROCID | TPU_WORKER_ID | JOB_COMPLETION_INDEX |
# DGEMMA_PROCESS_ID | 0 (one file per process, so one-process-per-GPU runs do not interleave).
set -euo pipefail
log_dir="${1:?usage: $0 LOG_DIR -- COMMAND [ARGS...]}"
shift
if [[ "${1:-}" == "--" ]]; then shift; fi
if [[ $# -eq 0 ]]; then echo "usage: $0 LOG_DIR -- COMMAND [ARGS...]" >&2; exit 2; fi
rank="${SLURM_PROCID:-${TPU_WORKER_ID:-${JOB_COMPLETION_INDEX:-${DGEMMA_PROCESS_ID:-0}}}}"
host="$(hostname -s 2>/dev/null || hostname)"
mkdir -p "$log_dir"
log="$log_dir/${host}-p${rank}.log"
echo "[dgemma] $(date -u +%Y-%m-%dT%H:%M:%SZ) host=$host rank=$rank cwd=$PWD: $*" >> "$log"
set +e
"$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
echo "[dgemma] $(date -u +%Y-%m-%dT%H:%M:%SZ) exit $rc" >> "$log"
exit "$rc"
