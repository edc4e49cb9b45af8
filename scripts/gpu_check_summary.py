#!/usr/bin/env python3
"""Summary of ./mn gpu-check (scripts/gpu_check.sh): reads what the check wrote into its output folder
and prints a short report against issue 5's targets; also writes summary.txt and summary.json there.
Standard library only (runs with any python3)."""
import argparse
import json
import os
import re


ERRORS = []  # benchmarks that reported an error (SkipWithError): their times are not figures
PEAK_F32_TFLOPS = 67.0  # H200 SXM fp32 (132 SMs x 128 FMA x 2 x 1.98 GHz)


def verdict(ok):
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


PHASE_ORDER = ["configure", "build", "tests", "bench_runtime", "bench_train_step", "torch_step", "train", "ddp_nccl",
               "profile",
               "memcheck", "racecheck", "synccheck", "initcheck", "total"]


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def benchmarks(path):
    """name without /min_time:..., /manual_time or /real_time -> the benchmark's JSON entry (iterations only)."""
    data = load_json(path) or {}
    out = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        name = re.sub(r"/(min_time|repeats|iterations):[^/]*", "", b.get("name", ""))
        name = re.sub(r"/(manual_time|real_time)$", "", name)
        if b.get("error_occurred"):
            ERRORS.append(f"{name}: {b.get('error_message', 'error')}")
            continue
        out[name] = b
    return out


def doctest_counts(log):
    """The last doctest summary in log: cases, passed, failed, skipped and the assertion counts."""
    counts = {}
    m = re.findall(r"\[doctest\] test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed\s*\|\s*(\d+) skipped", log)
    if m:
        counts.update(zip(("cases", "passed", "failed", "skipped"), map(int, m[-1])))
    m = re.findall(r"\[doctest\] assertions:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", log)
    if m:
        counts.update(zip(("assertions", "assertions_passed", "assertions_failed"), map(int, m[-1])))
    return counts


def failed_cases(log):
    """Names of the doctest cases whose report holds an error. doctest prints every case's header
    (--duration=true), so a header alone says nothing; ctest -V prefixes each line with 'N: '."""
    names = set()
    for block in re.split(r"^(?:\d+: )?={20,}\s*$", log, flags=re.M):
        name = re.search(r"^(?:\d+: )?TEST CASE:\s+(.*?)\s*$", block, re.M)
        if name and re.search(r"^(?:\d+: )?\S+:\d+: (?:FATAL )?ERROR:", block, re.M):
            names.add(name.group(1))
    return sorted(names)[:20]


NCU_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
             "second": 1e6}


def ncu_kernels(log):
    """Nsight Compute's --print-summary per-kernel output -> [(kernel, launches, total us)], slowest first.
    Groups of one kernel name (ncu splits them by launch shape) are added together."""
    totals = {}
    name, launches = None, 1
    for line in log.splitlines():
        head = re.match(r"^\s*(.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
        if head:
            name = re.sub(r"^void |\(anonymous namespace\)::|<unnamed>::", "", head.group(1))
            name = re.sub(r"\(.*$", "", name)  # the parameter list
            m = re.search(r"Invocations (\d+)\s*$", line)  # ncu 2025 ends the header line with it
            launches = int(m.group(1)) if m else 1
            continue
        m = re.match(r"^\s*gpu__time_duration\.sum\s+(\S+)\s+(?:[\d.,]+\s+){2}([\d.,]+)\s*$", line)
        if m and name and m.group(1) in NCU_UNITS:
            avg_us = float(m.group(2).replace(",", "")) * NCU_UNITS[m.group(1)]
            n, t = totals.get(name, (0, 0.0))
            totals[name] = (n + launches, t + launches * avg_us)
            name = None
    return sorted(((k, n, t) for k, (n, t) in totals.items()), key=lambda x: -x[2])


def to_ns(b, key="real_time"):
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
    return b[key] * scale


def fmt(v, spec=".2f", unit=""):
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def last_json(text):
    """The last line of a log that is a JSON object (mn-train --json's summary), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="{}")
    ap.add_argument("--build-ok", default="0")
    ap.add_argument("--have-gpu", default="0")
    ap.add_argument("--nvidia-smi", default="")
    ap.add_argument("--jobs", default="")
    ap.add_argument("--phase-logs", default="", help="folder of profile.log and sanitizer-<tool>.log")
    args = ap.parse_args()
    out = args.out
    phases = json.loads(args.phases)
    s = {"build_ok": args.build_ok == "1", "have_gpu": args.have_gpu == "1", "phases": phases,
         "jobs": args.jobs, "cores": os.cpu_count(), "gpu": read(args.nvidia_smi).strip() or None}
    lines = []

    # ---- tests ----
    log = read(os.path.join(out, "gpu_tests.log"))
    tests = {"ran": bool(log), **doctest_counts(log)}
    tests["skipped_no_device"] = "***Skipped" in log or "(Skipped)" in log
    m = re.search(r"(\d+)% tests passed, (\d+) tests? failed out of (\d+)", log)
    if m:
        tests["ctest"] = m.group(0)
    tests["failed_cases"] = failed_cases(log)
    s["tests"] = tests
    if not tests["ran"]:
        lines.append("gpu tests:   not run")
    elif tests["skipped_no_device"]:
        lines.append("gpu tests:   SKIPPED (no CUDA device)")
    elif "cases" in tests:
        lines.append(f"gpu tests:   {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped "
                     f"of {tests['cases']} test cases; assertions {tests.get('assertions_passed', '?')} passed, "
                     f"{tests.get('assertions_failed', '?')} failed")
        for name in tests["failed_cases"]:
            lines.append(f"             failed: {name}")
    else:
        lines.append(f"gpu tests:   no doctest summary (crashed or timed out?); {tests.get('ctest', '')}")

    # ---- runtime benchmarks ----
    rt = benchmarks(os.path.join(out, "mn_bench_cuda_runtime.json"))
    gemm = {}
    for key, label in (("BM_GemmF32/8192/0", "f32_8192"), ("BM_GemmF32/8192/1", "tf32_8192"),
                       ("BM_GemmF32/4096/0", "f32_4096")):
        if key in rt and "TFLOPS" in rt[key]:
            gemm[label] = rt[key]["TFLOPS"]  # a rate counter: TFLOP per second
    s["gemm_tflops"] = gemm
    if gemm:
        f32 = gemm.get("f32_8192")
        s["targets"] = {"gemm": verdict(None if f32 is None else f32 >= 0.7 * PEAK_F32_TFLOPS)}
        lines.append(f"GEMM:        f32 8192^3 {fmt(f32, '.1f')} TFLOP/s (target >= 47, 70% of 67): "
                     f"{s['targets']['gemm']}; "
                     f"TF32 {fmt(gemm.get('tf32_8192'), '.1f')}, f32 4096^3 {fmt(gemm.get('f32_4096'), '.1f')}")
    alloc = {}
    for size in ("512", "65536", "1048576", "16777216", "268435456"):
        hit, raw = rt.get(f"BM_CachingAllocatorHit/{size}"), rt.get(f"BM_CudaMallocFree/{size}")
        alloc[size] = {"hit_ns": to_ns(hit) if hit else None, "cudaMalloc_free_ns": to_ns(raw) if raw else None}
    s["allocator"] = alloc
    if any(v["hit_ns"] for v in alloc.values()):
        worst = max(v["hit_ns"] for v in alloc.values() if v["hit_ns"] is not None)
        def size(n):
            n = int(n)
            return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"
        parts = [f"{size(k)}: {fmt(v['hit_ns'], '.0f')} vs {fmt(v['cudaMalloc_free_ns'], '.0f')}"
                 for k, v in alloc.items()]
        s.setdefault("targets", {})["allocator"] = verdict(worst <= 1000)
        lines.append(f"allocator:   hit (ns) vs cudaMalloc+cudaFree (ns), worst hit {worst:.0f} ns (target <= 1000): "
                     f"{s['targets']['allocator']}")
        lines.append("             " + "; ".join(parts))

    # ---- index-heavy kernels (no target; what the index arithmetic leaves of the memory bandwidth) ----
    kernels = {}
    for k, label in enumerate(("bias_add", "permuted_copy", "max_pool", "conv_forward", "conv_input_grad",
                               "conv_bias_grad", "linear_bias_grad")):
        b = rt.get(f"BM_IndexedKernel/kernel:{k}")
        if b:
            kernels[label] = {"us": to_ns(b) / 1e3, "GBps": b.get("GBps")}
    s["indexed_kernels"] = kernels
    if kernels:
        lines.append("kernels:     " + "; ".join(f"{k} {fmt(v['us'], '.1f')} us ({fmt(v['GBps'], '.0f')} GB/s)"
                                               for k, v in kernels.items()))

    # ---- training steps ----
    st = benchmarks(os.path.join(out, "mn_bench_cuda_train_step.json"))
    torch = load_json(os.path.join(out, "torch_cuda_step.json")) or {}

    def median(name):
        b = st.get(name)
        if not b:
            return None
        return b.get("median_ms", to_ns(b) / 1e6)
    step = {"ours_gpu_ms": median("BM_CNN2_LayerwiseStep_CUDA"), "ours_cpu_ms": median("BM_CNN2_LayerwiseStep_CPU"),
            "ours_gpu_compiled_ms": median("BM_CNN2_LayerwiseStep_CUDA_Compiled"),
            "torch_gpu_ms": torch.get("cnn2_layerwise_b256_ms"), "torch_cpu_ms": torch.get("cnn2_layerwise_b256_cpu_ms"),
            "ours_direct_b128_ms": median("BM_CNN2_DirectStep_CUDA/128"),
            "ours_direct_b256_ms": median("BM_CNN2_DirectStep_CUDA/256"),
            "torch_direct_b128_ms": torch.get("cnn2_direct_b128_ms"),
            "torch_direct_b256_ms": torch.get("cnn2_direct_b256_ms"), "torch": torch.get("torch"),
            "torch_skipped": torch.get("skipped")}
    if step["ours_gpu_ms"] and step["ours_cpu_ms"]:
        step["cpu_over_gpu"] = step["ours_cpu_ms"] / step["ours_gpu_ms"]
    if step["ours_gpu_ms"] and step["torch_gpu_ms"]:
        step["ours_over_torch"] = step["ours_gpu_ms"] / step["torch_gpu_ms"]
    s["step"] = step
    if step["ours_gpu_ms"] or step["torch_gpu_ms"]:
        lines.append(f"mapped step: CNN2 layerwise 4x672 batch 256, median ms: ours cuda {fmt(step['ours_gpu_ms'])}, "
                     f"PyTorch cuda {fmt(step['torch_gpu_ms'])}, ours cpu {fmt(step['ours_cpu_ms'])} "
                     f"(PyTorch cpu {fmt(step['torch_cpu_ms'])})")
        cpu_threads = (st.get("BM_CNN2_LayerwiseStep_CPU") or {}).get("threads")
        t = s.setdefault("targets", {})
        t["step_vs_cpu"] = verdict(None if "cpu_over_gpu" not in step else step["cpu_over_gpu"] >= 5)
        t["step_vs_torch"] = verdict(None if "ours_over_torch" not in step else step["ours_over_torch"] <= 1)
        lines.append(f"             ours cpu ({fmt(cpu_threads, '.0f')} threads) / ours cuda = "
                     f"{fmt(step.get('cpu_over_gpu'), '.1f')}x (target >= 5): {t['step_vs_cpu']}; "
                     f"ours / PyTorch = {fmt(step.get('ours_over_torch'))} (target <= 1): {t['step_vs_torch']}")
        lines.append(f"             compiled (mn::compile) cuda {fmt(step['ours_gpu_compiled_ms'])} ms")
        lines.append(f"direct step: CNN2 batch 128 / 256, median ms: ours {fmt(step['ours_direct_b128_ms'])} / "
                     f"{fmt(step['ours_direct_b256_ms'])}, PyTorch {fmt(step['torch_direct_b128_ms'])} / "
                     f"{fmt(step['torch_direct_b256_ms'])}")
    elif step["torch_skipped"]:
        lines.append(f"steps:       no GPU figures (PyTorch: {step['torch_skipped']})")

    # ---- mn-train ----
    train_log = read(os.path.join(out, "mn-train.log"))
    train = last_json(train_log)
    s["mn_train"] = train
    if train:
        lines.append(f"mn-train:    cuda, cnn2 layerwise 672, 1 epoch batch 256: test accuracy "
                     f"{fmt(train.get('test_accuracy'), '.4f')}, {fmt(train.get('seconds'), '.1f')} s, "
                     f"{fmt(train.get('steps_per_second'), '.1f')} steps/s")
    elif train_log:
        lines.append("mn-train:    no JSON summary (failed? see mn-train.log)")

    # ---- mixed precision: the bf16 epoch against the f32 one, resnet18 step speed ----
    amp_dir = args.phase_logs or out  # gpu_check.sh keeps these logs in its build folder
    bf16 = last_json(read(os.path.join(amp_dir, "mn-train-bf16.log")))
    s["mn_train_bf16"] = bf16
    if bf16 and train:
        gap = (train.get("test_accuracy") or 0) - (bf16.get("test_accuracy") or 0)
        ok = "ok" if gap <= 0.003 else "OVER"
        lines.append(f"amp bf16:    cnn2 layerwise 1 epoch: test accuracy {fmt(bf16.get('test_accuracy'), '.4f')} "
                     f"vs f32 {fmt(train.get('test_accuracy'), '.4f')} (f32 - bf16 = {100 * gap:.2f} points, "
                     f"target <= 0.3): {ok}; {fmt(bf16.get('steps_per_second'), '.1f')} steps/s")
    for strategy in ("direct", "layerwise"):
        runs = {amp: last_json(read(os.path.join(amp_dir, f"mn-train-resnet18-{strategy}-{amp}.log")))
                for amp in ("f32", "bf16")}
        s[f"resnet18_{strategy}"] = runs
        if runs["f32"] and runs["bf16"]:
            f, b = runs["f32"].get("steps_per_second"), runs["bf16"].get("steps_per_second")
            ratio = b / f if f and b else None
            ok = "ok" if ratio is not None and ratio >= 2 else "OVER"
            lines.append(f"amp bf16:    resnet18 {strategy} b128 steps/s: f32 {fmt(f, '.1f')}, bf16 {fmt(b, '.1f')}, "
                         f"bf16 / f32 = {fmt(ratio)}x (target >= 2): {ok}")

    # ---- the slowest kernels of a few eager training steps (Nsight Compute) ----
    logs = args.phase_logs
    prof_log = read(os.path.join(logs, "profile.log")) if logs else ""
    kernels = ncu_kernels(prof_log)
    s["profile"] = [{"kernel": k, "launches": n, "total_us": t} for k, n, t in kernels]
    if kernels:
        whole = sum(t for _, _, t in kernels)
        lines.append(f"profile:     {sum(n for _, n, _ in kernels)} kernels of eager CNN2 layerwise steps, "
                     f"{whole:.0f} us of GPU time; the slowest names:")
        for k, n, t in kernels[:8]:
            lines.append(f"             {t / whole:5.1%} {t:8.1f} us {n:4d}x {k[:100]}")
    elif prof_log:
        lines.append("profile:     no per-kernel table (see gpu-check.log)")

    # ---- compute-sanitizer ----
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        t_log = read(os.path.join(logs, f"sanitizer-{tool}.log")) if logs else ""
        if not t_log:
            continue
        phase = phases.get(tool) or {}
        res = {**doctest_counts(t_log)}
        m = re.findall(r"ERROR SUMMARY: (\d+) errors?", t_log)
        if m:
            res["errors"] = int(m[-1])
        m = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", t_log)
        if m:
            res["errors"] = int(m[-1][1])
            res["warnings"] = int(m[-1][2])
        res["reports"] = re.findall(r"^=+ ((?:Invalid|Program hit|Uninitialized|Barrier|Race|Error|Warning).*)$",
                                    t_log, re.M)[:5]
        s.setdefault("sanitizers", {})[tool] = res
        label = f"{tool}:".ljust(13)
        if "device not supported" in t_log.lower():
            lines.append(f"{label}compute-sanitizer does not support this device here")
        elif phase.get("rc") in (124, 137):
            lines.append(f"{label}ran out of time after {phase['seconds']} s "
                         f"({res.get('passed', '?')} test cases passed before that)")
        elif "errors" in res:
            warn = f", {res['warnings']} warnings" if "warnings" in res else ""
            lines.append(f"{label}{res['errors']} errors{warn}, {res.get('passed', '?')} of "
                         f"{res.get('cases', '?')} test cases "
                         f"passed ({phase.get('seconds', '?')} s): "
                         f"{verdict(res['errors'] == 0 and res.get('failed', 1) == 0)}")
            for r in res["reports"]:
                lines.append(f"             {r[:160]}")
        else:
            lines.append(f"{label}no sanitizer summary (see gpu-check.log)")

    s["benchmark_errors"] = ERRORS
    for e in ERRORS[:10]:
        lines.append(f"bench error: {e}")

    times = ", ".join(f"{k} {v['seconds']} s" + (f" (exit {v['rc']})" if v["rc"] else "")
                      for k, v in sorted(phases.items(), key=lambda kv: PHASE_ORDER.index(kv[0])
                                         if kv[0] in PHASE_ORDER else len(PHASE_ORDER) - 1))
    head = [f"gpu-check: {s['gpu'] or 'no nvidia-smi'}; {s['cores']} cores, {args.jobs} jobs; "
            f"build {'ok' if s['build_ok'] else 'FAILED'}; CUDA device {'yes' if s['have_gpu'] else 'no'}",
            f"times:       {times}"]
    text = "\n".join(head + lines) + "\n"
    print("\n==== gpu-check summary ====\n" + text, end="")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
