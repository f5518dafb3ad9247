#!/usr/bin/env bash
# Three deliberate bugs, each of which `make test` (the fast tier) must catch: the mask's position offset, the
# halo's key count and the balanced layout's token order. Each is applied to a clean cpcompile/, `make test` runs
# with pytest's -x (it stops at the first failing test), the file is restored, and the table says which test
# failed first. Exit status 1 when some mutation passed `make test`.
#   bash scripts/mutations.sh            # all three
#   bash scripts/mutations.sh halo_keys  # one
set -uo pipefail
cd "$(dirname "$0")/.."
if ! git diff --quiet -- cpcompile; then
  echo "cpcompile/ has uncommitted changes: commit or stash them first" >&2
  exit 2
fi

# name|file|text|replacement (the text must occur exactly once)
MUTATIONS=(
  "mask_offset|cpcompile/ops/sites.py|    q_pos = plan.token_indices()|    q_pos = plan.token_indices() - plan.token_indices().min()"
  "halo_keys|cpcompile/plan.py|        return self.keys_needed(window, rank, documents=documents)|        return self.keys_needed(max(window - 1, 1), rank, documents=documents)"
  "balanced_order|cpcompile/layouts.py|    layout = torch.stack(leaves).sort(dim=1).values|    layout = torch.stack(leaves)"
)

status=0
summary=()
for m in "${MUTATIONS[@]}"; do
  IFS='|' read -r name file text replacement <<<"$m"
  if [ $# -gt 0 ] && [[ ! " $* " == *" $name "* ]]; then
    continue
  fi
  python3 - "$file" "$text" "$replacement" <<'EOF' || exit 2
import sys

path, text, replacement = sys.argv[1:]
source = open(path).read()
if source.count(text) != 1:
    sys.exit(f"{path}: the text to mutate occurs {source.count(text)} times, expected once: {text!r}")
open(path, "w").write(source.replace(text, replacement))
EOF
  log="$(mktemp -t "mutation-$name.XXXX.log")"
  start=$SECONDS
  PYTEST_ADDOPTS="-x -p no:cacheprovider" make test >"$log" 2>&1
  rc=$?
  git checkout -- "$file"
  first=$(grep -m1 -E '^(FAILED|ERROR) ' "$log" | cut -c1-150)
  if [ "$rc" -eq 0 ]; then
    status=1
    summary+=("| $name | \`$file\` | PASSED make test (not caught) | $((SECONDS - start)) s |")
  else
    summary+=("| $name | \`$file\` | make test failed (rc $rc): ${first:-see $log} | $((SECONDS - start)) s |")
  fi
done
echo "| mutation | file | result | wall time |"
echo "| --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
exit $status
