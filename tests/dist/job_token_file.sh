#!/usr/bin/env bash
# mn-run --job-token-file (test dist_job_token_file_2): the launcher's store and both ranks use the token
# in a mode-600 file and the job passes; a file others may read is refused before anything starts.
#   job_token_file.sh MN_RUN DIST_WORKER
set -euo pipefail
mn_run=$1 worker=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
umask 077
printf 'job-secret-%s\n' "$RANDOM$RANDOM" >"$dir/token"
unset MN_JOB_TOKEN MN_JOB_TOKEN_FILE
"$mn_run" --job-token-file "$dir/token" --nproc-per-node 2 "$worker" collectives
chmod 644 "$dir/token"
if out=$("$mn_run" --job-token-file "$dir/token" --nproc-per-node 2 "$worker" collectives 2>&1); then
  echo "FAILED: a world-readable token file was accepted" >&2
  exit 1
fi
if ! grep -q "chmod 600" <<<"$out"; then
  printf 'FAILED: expected the refusal to say chmod 600, got:\n%s\n' "$out" >&2
  exit 1
fi
echo "job token file: passed"
