#!/usr/bin/env bash
# Installs jaxrl, with the `tpu` extra, on every worker of a TPU VM, into REMOTE_DIR/.venv.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: setup.sh --name NAME --zone ZONE [--project PROJECT] [--repo URL [--ref REF]]
                [--remote-dir DIR] [--python PYTHON] [--dry-run]

On every worker (--worker=all), puts jaxrl's source in ~/DIR and runs
  PYTHON -m venv .venv && .venv/bin/pip install -e ".[tpu]"
installing PYTHON with apt-get first if the worker lacks it (TPU VM images ship Python 3.10;
jaxrl needs 3.11 or newer). Safe to re-run: it updates the source and the install in place.

source, one of:
  (default)                 this checkout's working tree (uncommitted changes included, minus
                            .git, .venv, runs, caches): tar'ed to \${TMPDIR:-/tmp}/jaxrl-NAME.tar.gz,
                            copied to every worker with \`gcloud compute tpus tpu-vm scp\`
  --repo URL [--ref REF]    git clone URL on every worker and check out REF (a branch, tag or
                            commit; default HEAD, the remote's default branch)

  --remote-dir DIR          where jaxrl lives on each worker, relative to the home directory
                            (default jaxrl; launch.sh takes the same flag)
  --python PYTHON           interpreter for the venv (default python3.11)

$COMMON_HELP
USAGE
}

REPO="" REF=HEAD REMOTE_DIR=jaxrl PYTHON=python3.11
while (($#)); do
  case $1 in
    --repo | --repo=*) opt_value "$@" && REPO=$OPTVAL ;;
    --ref | --ref=*) opt_value "$@" && REF=$OPTVAL ;;
    --remote-dir | --remote-dir=*) opt_value "$@" && REMOTE_DIR=$OPTVAL ;;
    --python | --python=*) opt_value "$@" && PYTHON=$OPTVAL ;;
    *) parse_common "$@" || die "unknown argument: $1 (see --help)" ;;
  esac
  shift "$OPTSHIFT"
done
require "$NAME" --name
require "$ZONE" --zone
need_gcloud
where
dir=$(quote "$REMOTE_DIR")
py=$(quote "$PYTHON")
install="command -v $py >/dev/null || { sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; }; cd $dir; $py -m venv .venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -q -e \".[tpu]\""

if [[ -n $REPO ]]; then
  fetch="if [ ! -d $dir/.git ]; then git clone -q $(quote "$REPO") $dir; fi; git -C $dir fetch -q origin $(quote "$REF"); git -C $dir checkout -q --force FETCH_HEAD"
else
  tarball="${TMPDIR:-/tmp}/jaxrl-$NAME.tar.gz"
  run tar -czf "$tarball" --exclude=.git --exclude=.venv --exclude=runs --exclude=tpu-logs \
    --exclude=__pycache__ --exclude=.jax_cache --exclude=.pytest_cache --exclude='*.egg-info' \
    -C "$ROOT" .
  run gcloud compute tpus tpu-vm scp "$tarball" "$NAME:jaxrl-src.tar.gz" "${WHERE[@]}" --worker=all
  fetch="mkdir -p $dir; tar -xzf jaxrl-src.tar.gz -C $dir; rm jaxrl-src.tar.gz"
fi
run gcloud compute tpus tpu-vm ssh "$NAME" "${WHERE[@]}" --worker=all \
  "--command=set -eu; $fetch; $install"
