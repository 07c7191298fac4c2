#!/usr/bin/env bash
# Single-process local launch: the same command a cluster target renders, on this machine.
# Usage: launch/local/train.sh configs/stage1/tiny.yaml [key=value ...]
set -euo pipefail
config="${1:?usage: $0 CONFIG [overrides...]}"
shift
exec python -m dgemma.cli train --config "$config" "$@"
