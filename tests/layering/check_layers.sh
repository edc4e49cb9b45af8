#!/usr/bin/env bash
# The layering check (ctest test `layering`, tests/layering/tests.cmake). For every layer it
#  1. compiles a probe that includes one of the layer's own headers with the layer's real include
#     directories: it must compile (so the probes below fail for the right reason);
#  2. compiles, with the same directories, a probe including a header of each layer the layer may not
#     use: it must fail because the header is not found;
#  3. reads the layer's static library with nm: no symbol it needs may be defined only by a layer it
#     may not use (an upward call that would not link without that layer).
# Usage: check_layers.sh CXX NM WORK_DIR LAYER_SPEC...
#   LAYER_SPEC = name|library file|allowed layers, comma-separated|include dirs, colon-separated
#   listed lowest layer first. Each layer's probe header is PROBE_<name> below.
set -uo pipefail

if [[ $# -lt 4 ]]; then
  echo "usage: $0 CXX NM WORK_DIR LAYER_SPEC..." >&2
  exit 2
fi
cxx=$1 nm=$2 work=$3
shift 3

declare -A PROBE=([core]=core/tensor.h [kernels]=kernels/factories.h [autograd]=autograd/ops.h
                  [nn]=nn/module.h [mapping]=mapping/generator.h [dist]=dist/store.h)
declare -A LIB ALLOWED INCLUDES
layers=()
for spec in "$@"; do
  IFS='|' read -r name lib allowed includes <<<"$spec"
  [[ -n ${PROBE[$name]:-} ]] || { echo "FAIL: no probe header for layer '$name'" >&2; exit 2; }
  layers+=("$name")
  LIB[$name]=$lib ALLOWED[$name]=",$name,$allowed," INCLUDES[$name]=$includes
done

rm -rf "$work" && mkdir -p "$work"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# compile LAYER HEADER: 0 when a file including HEADER compiles with LAYER's include directories; the
# compiler's output is left in $work/LAYER-<header>.log.
compile() {
  local layer=$1 header=$2 flags=() dir
  local log="$work/$layer-${header//\//_}.log" src="$work/$layer-${header//\//_}.cpp"
  IFS=':' read -r -a dirs <<<"${INCLUDES[$layer]}"
  for dir in "${dirs[@]}"; do [[ -n $dir ]] && flags+=("-I$dir"); done
  printf '#include "%s"\nint main() { return 0; }\n' "$header" >"$src"
  "$cxx" -std=c++20 -fsyntax-only "${flags[@]}" "$src" >"$log" 2>&1
}

for layer in "${layers[@]}"; do
  own=${PROBE[$layer]}
  if compile "$layer" "$own"; then
    echo "ok: $layer compiles its own $own"
  else
    fail "$layer cannot compile its own header $own:"; head -5 "$work/$layer-${own//\//_}.log"
  fi
  for other in "${layers[@]}"; do
    [[ ${ALLOWED[$layer]} == *",$other,"* ]] && continue
    header=${PROBE[$other]}
    log="$work/$layer-${header//\//_}.log"
    if compile "$layer" "$header"; then
      fail "$layer may not include $other/, but #include \"$header\" compiles"
    elif grep -qE "$header.*(No such file|not found)|(No such file|not found).*$header" "$log"; then
      echo "ok: $layer cannot include $header (not found)"
    else
      fail "$layer including $header failed for another reason than a missing header:"; head -5 "$log"
    fi
  done
done

# Symbols by layer: what each library defines and what it needs. A layer's own weak definitions (V, W:
# inline functions and template instantiations every object that uses them carries) count as its own;
# a higher layer's weak ones do not make a dependency (a C++17 CUDA object that needs an std::string
# member another compiler emitted inline in nn is satisfied by libstdc++), so only strong definitions
# (.strong) are searched for upward needs.
for layer in "${layers[@]}"; do
  "$nm" --defined-only "${LIB[$layer]}" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[A-Z]$/ && $2 != "U" { print $3 }' |
    sort -u >"$work/$layer.defined"
  "$nm" --defined-only "${LIB[$layer]}" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[A-Z]$/ && $2 !~ /^[UVW]$/ { print $3 }' |
    sort -u >"$work/$layer.strong"
  "$nm" --undefined-only "${LIB[$layer]}" 2>/dev/null | awk '{ print $NF }' | sort -u >"$work/$layer.needed"
  [[ -s $work/$layer.defined ]] || fail "nm found no symbols in ${LIB[$layer]}"
done
for layer in "${layers[@]}"; do
  # Needed by the layer, not defined by itself, defined by a layer it may not use.
  comm -23 "$work/$layer.needed" "$work/$layer.defined" >"$work/$layer.external"
  for other in "${layers[@]}"; do
    [[ ${ALLOWED[$layer]} == *",$other,"* ]] && continue
    comm -12 "$work/$layer.external" "$work/$other.strong" >"$work/$layer-$other.upward"
    if [[ -s $work/$layer-$other.upward ]]; then
      fail "mn_$layer needs $(wc -l <"$work/$layer-$other.upward") symbol(s) that only mn_$other defines, e.g.:"
      head -5 "$work/$layer-$other.upward" | c++filt | sed 's/^/  /'
    fi
  done
  echo "ok: checked what mn_$layer links against"
done

if ((failures > 0)); then
  echo "FAIL: $failures layering check(s) failed"
  exit 1
fi
echo "PASS: layering"
