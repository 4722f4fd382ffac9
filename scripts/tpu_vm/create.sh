#!/usr/bin/env bash
# Creates a Cloud TPU VM (one host or a pod slice) for jaxrl.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: create.sh --name NAME --zone ZONE --accelerator-type TYPE [--project PROJECT]
                 [--version RUNTIME] [--spot] [--dry-run]

Runs: gcloud compute tpus tpu-vm create NAME --zone=ZONE [--project=PROJECT]
          --accelerator-type=TYPE --version=RUNTIME [--spot]

--version defaults by TPU generation: v5litepod-* -> v2-alpha-tpuv5-lite, v5p-* -> v2-alpha-tpuv5,
v6e-* -> v2-alpha-tpuv6e, v4-*/v3-*/v2-* -> tpu-ubuntu2204-base; pass it for anything else.

  --spot                    create a Spot TPU (cheaper; can be preempted at any time)

$COMMON_HELP

example (a v5e-16: 4 hosts x 4 chips):
  scripts/tpu_vm/create.sh --name jaxrl-v5e16 --zone us-west4-a --project my-proj \\
      --accelerator-type v5litepod-16
USAGE
}

SPOT=0
while (($#)); do
  case $1 in
    --spot) SPOT=1 OPTSHIFT=1 ;;
    *) parse_common "$@" || die "unknown argument: $1 (see --help)" ;;
  esac
  shift "$OPTSHIFT"
done
require "$NAME" --name
require "$ZONE" --zone
require "$ACCELERATOR_TYPE" --accelerator-type
if [[ -z $VERSION ]]; then
  case $ACCELERATOR_TYPE in
    v5litepod-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v4-* | v3-* | v2-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "missing required flag --version (no default for accelerator type $ACCELERATOR_TYPE)" ;;
  esac
fi
need_gcloud
where
cmd=(gcloud compute tpus tpu-vm create "$NAME" "${WHERE[@]}"
  "--accelerator-type=$ACCELERATOR_TYPE" "--version=$VERSION")
if ((SPOT)); then
  cmd+=(--spot)
fi
run "${cmd[@]}"
