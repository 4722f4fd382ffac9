#!/usr/bin/env bash
# Runs the same `python -m jaxrl.train` on every worker of a TPU VM, then collects the logs.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: launch.sh --name NAME --zone ZONE [--project PROJECT] --config CONFIG
                 [--logs DIR] [--port PORT] [--remote-dir DIR] [--dry-run] [-- TRAIN_ARGS...]

On every worker at once (--worker=all), in ~/DIR (as set up by setup.sh):
  .venv/bin/python -m jaxrl.train --config CONFIG TRAIN_ARGS... <distributed flags>
with the output of worker W in ~/DIR/tpu-logs/worker-W.log (worker 0's also on this terminal);
then copies every worker's log into DIR (gcloud compute tpus tpu-vm scp --worker=all), also when
the run fails. Exits with the run's status.

Joining the hosts: jaxrl's own detection (distributed.auto) reads only environment variables
(TPU_WORKER_HOSTNAMES, TPU_WORKER_ID), never the TPU VM metadata server, and explicit
distributed.* values win over it. So each worker reads, from the metadata server (the same
source JAX's auto-detection uses), its worker number and the worker list, and appends
  --config.distributed.coordinator_address=<worker 0's IP>:PORT
  --config.distributed.num_processes=<number of workers>
  --config.distributed.process_id=<this worker's number>
The config itself needs nothing distributed, but must be valid for several processes:
rollout.engine = 'static' (any rollout.lag), and a mesh whose sizes multiply to the slice's
chip count (16 on a v5e-16; mesh.data = -1 takes what is left).

  --config CONFIG           recipe, relative to DIR on the workers (required), e.g.
                            configs/qwen2_5_0_5b_gsm8k.py
  --logs DIR                local directory for the collected logs (default tpu-logs/NAME)
  --port PORT               coordinator port on worker 0 (default 8476)
  --remote-dir DIR          jaxrl's directory on each worker, relative to home (default jaxrl)
  -- TRAIN_ARGS...          passed to jaxrl.train unchanged, e.g. -- --config.train.steps=100

$COMMON_HELP
USAGE
}

CONFIG="" LOGS="" PORT=8476 REMOTE_DIR=jaxrl TRAIN_ARGS=()
while (($#)); do
  case $1 in
    --config | --config=*) opt_value "$@" && CONFIG=$OPTVAL ;;
    --logs | --logs=*) opt_value "$@" && LOGS=$OPTVAL ;;
    --port | --port=*) opt_value "$@" && PORT=$OPTVAL ;;
    --remote-dir | --remote-dir=*) opt_value "$@" && REMOTE_DIR=$OPTVAL ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) parse_common "$@" || die "unknown argument: $1 (to pass it to jaxrl.train, put it after --)" ;;
  esac
  shift "$OPTSHIFT"
done
require "$NAME" --name
require "$ZONE" --zone
require "$CONFIG" --config
[[ $PORT =~ ^[0-9]+$ ]] || die "--port must be a number, got $PORT"
LOGS=${LOGS:-tpu-logs/$NAME}
need_gcloud
where

# The command each worker runs (in bash, the login shell on TPU VM images). $w, $n, $c are
# evaluated on the worker.
train=$(quote_all .venv/bin/python -m jaxrl.train --config "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
md='curl -sSf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes'
remote="set -euo pipefail; cd $(quote "$REMOTE_DIR"); mkdir -p tpu-logs; \
w=\$($md/agent-worker-number); e=\$($md/worker-network-endpoints); \
n=\$(echo \"\$e\" | tr , \" \" | wc -w); c=\${e%%,*}; c=\${c##*:}; \
$train --config.distributed.coordinator_address=\"\$c:$PORT\" \
--config.distributed.num_processes=\"\$n\" --config.distributed.process_id=\"\$w\" \
2>&1 | if [ \"\$w\" = 0 ]; then tee tpu-logs/worker-\$w.log; else cat > tpu-logs/worker-\$w.log; fi"

run mkdir -p "$LOGS"
status=0
run gcloud compute tpus tpu-vm ssh "$NAME" "${WHERE[@]}" --worker=all "--command=$remote" || status=$?
run gcloud compute tpus tpu-vm scp "$NAME:$REMOTE_DIR/tpu-logs/worker-*.log" "$LOGS/" "${WHERE[@]}" \
  --worker=all || true
if ((!DRY_RUN)); then
  printf '%s: logs in %s; jaxrl.train exited with status %d\n' "$SCRIPT" "$LOGS" "$status" >&2
fi
exit "$status"
