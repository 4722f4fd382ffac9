#!/usr/bin/env bash
# Deletes a Cloud TPU VM (every host of it), without asking.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: delete.sh --name NAME --zone ZONE [--project PROJECT] [--dry-run]

Runs: gcloud compute tpus tpu-vm delete NAME --zone=ZONE [--project=PROJECT] --quiet
(--quiet: no confirmation prompt; the TPU and its disks are gone, so collect logs first.)

$COMMON_HELP
USAGE
}

while (($#)); do
  parse_common "$@" || die "unknown argument: $1 (see --help)"
  shift "$OPTSHIFT"
done
require "$NAME" --name
require "$ZONE" --zone
need_gcloud
where
run gcloud compute tpus tpu-vm delete "$NAME" "${WHERE[@]}" --quiet
