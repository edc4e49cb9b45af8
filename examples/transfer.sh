#!/usr/bin/env bash
# Transfer learning on Fashion-MNIST with mn-train: a CNN trained directly on classes 0-4 is carried
# over to classes 5-9 four ways, and their test accuracy (on 5-9) and trainable counts are compared:
#   pretrain   direct training on 0-4 (the source model; its weights.safetensors is the starting point)
#   finetune   --strategy finetuning: the pretrained weights plus a latent-driven block modulation
#   full-ft    --strategy direct --init-from: every weight trained, starting from the pretrained ones
#   scratch    --strategy direct from the usual init
#   lwt        --strategy layerwise from scratch, for a mapped run of the same trainable count
#
#   examples/transfer.sh                         # 3 epochs each, full data, runs/transfer
#   EPOCHS=1 EXTRA="--limit 4000" examples/transfer.sh
#
# Environment: BUILD (build directory, default build), OUT (default runs/transfer), TARGET (cnn2),
# EPOCHS (3), LATENT (latent length per group, 256), BLOCK (--block-size, 1: the generator's default of
# 250, the reference's, leaves cnn2 too few modulation elements to move to new classes), FT_ALPHA
# (--finetune-alpha, 0.01), FT_LR (learning rate of the fine-tuning latents, default mn-train's 1e-2),
# SEED (0), EXTRA (more mn-train flags for every run, e.g. --threads 2 or --limit N).
# Prints a Markdown table and writes it to OUT/table.md; each run's files are in OUT/<name>.
set -euo pipefail

BUILD=${BUILD:-build}
OUT=${OUT:-runs/transfer}
TARGET=${TARGET:-cnn2}
EPOCHS=${EPOCHS:-3}
LATENT=${LATENT:-256}
BLOCK=${BLOCK:-1}
FT_ALPHA=${FT_ALPHA:-0.01}
FT_LR=${FT_LR:-}
SEED=${SEED:-0}
EXTRA=${EXTRA:-}
TRAIN="$BUILD/examples/mn-train"
[[ -x $TRAIN ]] || { echo "transfer.sh: $TRAIN not found; build it (cmake --build $BUILD --target mn-train)" >&2; exit 1; }
mkdir -p "$OUT"

# run NAME FLAGS...: one mn-train run with --json; its summary line goes to OUT/NAME.json and its
# command to OUT/NAME.cmd.
run() {
  local name=$1
  shift
  local cmd=("$TRAIN" --target "$TARGET" --epochs "$EPOCHS" --seed "$SEED" --out "$OUT/$name" --json $EXTRA "$@")
  echo "${cmd[*]}" | tee "$OUT/$name.cmd" >&2
  "${cmd[@]}" | tail -n 1 > "$OUT/$name.json"
}

run pretrain --strategy direct --classes 0-4
PRE="$OUT/pretrain/weights.safetensors"
run finetune --strategy finetuning --pretrained "$PRE" --classes 5-9 --latent-dim "$LATENT" \
  --block-size "$BLOCK" --finetune-alpha "$FT_ALPHA" ${FT_LR:+--lr "$FT_LR"}
run full-ft --strategy direct --init-from "$PRE" --classes 5-9
run scratch --strategy direct --classes 5-9
run lwt --strategy layerwise --latent-dim "$LATENT" --classes 5-9

python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys
out = sys.argv[1]
rows = [("pretrain", "direct on classes 0-4 (source)"),
        ("finetune", "fine-tune through latents (finetuning)"),
        ("full-ft", "fine-tune every weight (direct --init-from)"),
        ("scratch", "direct from scratch"),
        ("lwt", "layerwise from scratch")]
print("| run | classes | trainable | test acc. | train acc. | epochs | seconds |")
print("|---|---|---:|---:|---:|---:|---:|")
for name, what in rows:
    j = json.load(open(f"{out}/{name}.json"))
    cls = "0-4" if name == "pretrain" else "5-9"
    print(f"| {what} | {cls} | {j['trainable_params']:,} | {100 * j['test_accuracy']:.2f} % | "
          f"{100 * j['train_accuracy']:.2f} % | {j['epochs']} | {j['seconds']:.0f} |")
PY
