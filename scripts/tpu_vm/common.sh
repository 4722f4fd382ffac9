# shellcheck shell=bash
# Shared by create.sh, setup.sh, launch.sh and delete.sh (sourced, never run): the common flags,
# quoting, and `run`, which prints a command and runs it (or, with --dry-run, only prints it).
#
# The calling script defines `usage` (printed by --help) before calling `parse_common`.

# Set here, read by the scripts that source this file.
# shellcheck disable=SC2034
{
  NAME="" ZONE="" PROJECT="" ACCELERATOR_TYPE="" VERSION="" DRY_RUN=0
  COMMON_HELP="common flags:
  --name NAME               TPU VM name (required)
  --zone ZONE               e.g. us-west4-a (required)
  --project PROJECT         GCP project (default: gcloud's configured project)
  --accelerator-type TYPE   e.g. v5litepod-16 (a v5e-16: 4 hosts x 4 chips); used by create.sh
  --version RUNTIME         TPU software version, e.g. v2-alpha-tpuv5-lite; used by create.sh
  --dry-run                 print every command, one per line, ready to paste; run nothing
  -h, --help                this message"
}
SCRIPT=$(basename "$0")
OPTVAL="" OPTSHIFT=1

die() {
  printf '%s: %s\n' "$SCRIPT" "$*" >&2
  exit 2
}

# opt_value "$@": the value of the option in $1, given as `--flag=value` or `--flag value`.
# Sets OPTVAL and OPTSHIFT (the number of words it used).
opt_value() {
  if [[ $1 == --*=* ]]; then
    OPTVAL=${1#*=} OPTSHIFT=1
  elif (($# >= 2)); then
    OPTVAL=$2 OPTSHIFT=2
  else
    die "$1 needs a value"
  fi
}

# parse_common "$@": handles one common flag at $1 (setting OPTSHIFT); returns 1 if $1 is not one.
parse_common() {
  OPTSHIFT=1
  case $1 in
    --name | --name=*) opt_value "$@" && NAME=$OPTVAL ;;
    --zone | --zone=*) opt_value "$@" && ZONE=$OPTVAL ;;
    --project | --project=*) opt_value "$@" && PROJECT=$OPTVAL ;;
    --accelerator-type | --accelerator-type=*) opt_value "$@" && ACCELERATOR_TYPE=$OPTVAL ;;
    --version | --version=*) opt_value "$@" && VERSION=$OPTVAL ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) return 1 ;;
  esac
}

# require VALUE FLAG: fails naming FLAG when VALUE is empty.
require() {
  [[ -n $1 ]] || die "missing required flag $2 (see --help)"
}

# quote WORD: WORD as one shell word: as is when it holds only safe characters, else in single
# quotes (a ' inside becomes '\''), after the `--flag=` of a `--flag=value`. Same meaning as
# `printf %q`, easier to read and to paste.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ ^(--[A-Za-z0-9.-]+=)(.+)$ ]]; then  # --flag=value: quote only the value
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# quote_all WORD...: the words quoted and joined by spaces: a command line to paste into a shell.
quote_all() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(quote "$w")"
  done
  printf '%s' "$out"
}

# run CMD...: prints the command (to stdout with --dry-run, else to stderr after "+ ") and runs it
# unless --dry-run.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(quote_all "$@")"
    return 0
  fi
  printf '+ %s\n' "$(quote_all "$@")" >&2
  "$@"
}

# where: the --zone/--project flags every gcloud tpu-vm command takes, into the array WHERE.
where() {
  WHERE=("--zone=$ZONE")
  if [[ -n $PROJECT ]]; then
    WHERE+=("--project=$PROJECT")
  fi
}

need_gcloud() {
  if ((!DRY_RUN)) && ! command -v gcloud >/dev/null; then
    die "gcloud not found on PATH (install the Google Cloud CLI, or use --dry-run)"
  fi
}
