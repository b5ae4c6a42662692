"""`fastdist-bench adapters`: the fused 4-bit linear against its alternatives, and fine-tuning a 4-bit model.

Kernels: an [out, in] layer (default 4096 x 4096) at each token count. ``qlinear`` (fastdist, NF4 or INT4 blocks of
64) against dequantize-then-matmul (fastdist's dequantize4, then ``F.linear``), the float32 matmul (``F.linear`` on
the float weight) and bitsandbytes' NF4 ``Linear4bit`` (its CPU forward, float32 compute), interleaved in the same
rounds with a STREAM-like copy (``fastdist-bench kernels``' timer and copy). GB/s counts the packed weight and its
scales read once, against the copy's bytes moved (read + write) in the same rounds.

Fine-tuning (``--finetune``): a small LLaMA (transformers' LlamaConfig) pretrained on the Python standard library's
sources, quantized to 4 bits, then fine-tuned on the English prose of ``pydoc_data/topics.py`` with each method at the
same trainable-parameter budget, same data, same steps and seeds, and the same learning-rate grid (``--lrs``: each
method's rate is the one with its lowest mean loss on a validation split carved from the fine-tuning text, never the
held-out one); held-out loss and next-token accuracy (mean +- std over seeds) at that rate, every rate's losses,
trainable parameters, step time (the methods take turns on each batch, so every method's steps see the same machine
load; also as a ratio to LoRA on the float base, seed by seed) in wall-clock and in the process's CPU
time (which a loaded machine does not inflate when the run has one torch thread: ``--threads 1``), peak memory, and for
the mergeable methods the merged 4-bit loss.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from fastdist.bench import report
from fastdist.bench.kernels import COPY_BYTES, kernel_timer
from fastdist.bench.report import MIB, col, fixed, times
from fastdist.bench.toolkit import at_least, comma_list, progress, shape_type
from fastdist.ops import dequantize4, qlinear, quantize4

METHODS = ("lora-float", "qlora-bnb", "qlora", "qalora", "qbara", "qahira")
# method: (base, adapter method). Bases: float32; bitsandbytes NF4 blocks of 64 under PEFT's LoRA (QLoRA); fastdist
# NF4 blocks of 64; INT4 blocks of 32 (QA-LoRA pools by its group, 32); INT4 2-D blocks of 8 rows x 4 columns (one
# scale and zero per 32 values, like blocks of 32), on which QA-HiRA merges exactly.
FINETUNE = {"lora-float": ("float", "lora"), "qlora-bnb": ("bnb-nf4", "peft-lora"), "qlora": ("nf4", "lora"),
            "qalora": ("int4-32", "qalora"), "qbara": ("nf4", "qbara"), "qahira": ("int4-8x4", "qahira")}
BASES = {"nf4": ("nf4", 64, 1), "int4-32": ("int4", 32, 1), "int4-8x4": ("int4", 4, 8)}  # scheme, block, block_rows
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
BATCH, EVAL_BATCHES, LR = 8, 6, 2e-3


def model_config(hidden: int, layers: int, seq: int) -> dict:
    """A LLaMA over byte tokens. QA-HiRA's d^2 / 32 parameters per d x d projection are LoRA r = d / 64's."""
    return {"vocab_size": 256, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": seq}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", type=shape_type(2), default=(4096, 4096), help="layer [out, in] (default 4096x4096)")
    p.add_argument("--tokens", type=comma_list(int), default=[1, 4, 16, 2048],
                   help="token counts (default 1,4,16,2048)")
    p.add_argument("--schemes", type=comma_list(str), default=["nf4", "int4"], help="nf4,int4")
    p.add_argument("--block", type=int, default=64, help="quantization block (default 64)")
    p.add_argument("--repeats", type=at_least(5), default=7, help="timed rounds, median reported (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--no-bnb", action="store_true", help="leave bitsandbytes out")
    p.add_argument("--finetune", action="store_true", help="also run the fine-tuning comparison")
    p.add_argument("--skip-kernels", action="store_true", help="only the fine-tuning comparison")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps per method and seed")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--seeds", type=comma_list(int), default=[0, 1, 2])
    p.add_argument("--rank", type=int, default=None,
                   help="the LoRA rank that sets every method's budget (default hidden / 64: QA-HiRA's budget)")
    p.add_argument("--hidden", type=int, default=128, help="model width (a multiple of 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--methods", type=comma_list(str), default=list(METHODS), help=",".join(METHODS))
    p.add_argument("--lrs", type=comma_list(float), default=[LR],
                   help=f"fine-tuning learning rates, the same grid for every method (default {LR})")


def _bnb_linear(weight: torch.Tensor, block: int):
    """bitsandbytes' NF4 Linear4bit holding `weight`, or None without bitsandbytes."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=False, compute_dtype=torch.float32,
                              quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", blocksize=block)
    return layer.to("cpu")  # Params4bit quantizes when moved to a device


def kernel_rows(args: argparse.Namespace) -> tuple[list[dict], list[float], str]:
    out_f, in_f = args.shape
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=g) * 0.02
    timer, backend = kernel_timer("cpu")
    src = torch.ones(COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bnb_layer = None if args.no_bnb else _bnb_linear(weight, args.block)
    rows, copy_samples = [], []
    bar = progress(len(args.schemes) * len(args.tokens), "adapters kernels")
    for scheme in args.schemes:
        packed, scales, zeros = quantize4(weight, scheme, args.block)
        weight_bytes = packed.numel() + 4 * scales.numel() * (2 if zeros is not None else 1)
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f, generator=g)
            fns = {"qlinear": lambda: qlinear(x, packed, scales, zeros, scheme),
                   "dequant+matmul": lambda: F.linear(x, dequantize4(packed, scales, zeros, scheme)),
                   "fp32 matmul": lambda: F.linear(x, weight)}
            if bnb_layer is not None and scheme == "nf4":
                fns["bnb Linear4bit"] = lambda: bnb_layer(x)
            with torch.no_grad():
                want = fns["dequant+matmul"]()
                # The same 4-bit weight (bitsandbytes' NF4 codes and absmax are ours bit for bit); bitsandbytes'
                # CPU forward computes in reduced precision, so its difference is recorded and bounded loosely.
                diffs = {name: ((fn() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
                         for name, fn in fns.items() if name != "fp32 matmul"}
                for name, bound in (("qlinear", 1e-5), ("bnb Linear4bit", 2e-2)):
                    if diffs.get(name, 0.0) > bound:
                        raise RuntimeError(f"fastdist-bench adapters: {name} disagrees with dequant+matmul "
                                           f"({scheme}, {tokens} tokens): max difference {diffs[name]:.2e} of the "
                                           "output's largest value")
                samples = timer(list(fns.values()) + [lambda: dst.copy_(src)], args.repeats, args.warmup)
            copy_s = samples[-1]
            copy_samples += copy_s
            ours = statistics.median(samples[0])
            row = {"scheme": scheme, "tokens": tokens, "shape": [out_f, in_f], "weight_bytes": weight_bytes,
                   "qlinear_s": ours, "gbps": weight_bytes / ours / 1e9,
                   "pct_copy": 100 * statistics.median(weight_bytes * c / (2 * COPY_BYTES * s)
                                                       for s, c in zip(samples[0], copy_s)),
                   "max_rel_diff": diffs, "samples_s": {name: s for name, s in zip(fns, samples)},
                   "copy_samples_s": copy_s}
            for name, s in zip(list(fns)[1:], samples[1:]):
                row[f"{name}_s"] = statistics.median(s)
                row[f"vs {name}"] = statistics.median(s) / ours
            rows.append(row)
            bar.step(f"{scheme} {tokens}")
    return rows, copy_samples, backend


def run(args: argparse.Namespace) -> dict:
    if args.skip_kernels and not args.finetune:
        raise SystemExit("fastdist-bench adapters: --skip-kernels leaves nothing to run without --finetune")
    with report.torch_threads(args.threads):
        load = _loadavg()
        rows, copy_samples, backend = ([], [], f"fastdist CPU kernels, {torch.get_num_threads()} torch threads") \
            if args.skip_kernels else kernel_rows(args)
        env = report.environment(backend=backend, device="cpu", ranks=1, network="-")
        env["loadavg"] = load
        result = {"suite": "adapters", "env": env, "kernels": rows, "copy_samples_s": copy_samples,
                  "copy_gbps": 2 * COPY_BYTES / statistics.median(copy_samples) / 1e9 if copy_samples else None}
        if args.finetune:
            result["finetune"] = finetune(args)
    print(report.format_environment(env))
    print(f"# load average at the start {env['loadavg']}")
    print(report.text_parts(tables(result)))
    return result


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "-"


def tables(result: dict) -> list[report.Part]:
    """The kernel table, and the fine-tuning table when the run has one."""
    kernels = [col("scheme", "scheme"), col("tokens", "tokens", fixed(0)),
               col("qlinear (ms)", lambda r: 1e3 * r["qlinear_s"], fixed(2)), col("GB/s", "gbps", fixed(2)),
               col("of copy (%)", "pct_copy", fixed(1)),
               col("dequant+matmul (ms)", lambda r: 1e3 * r["dequant+matmul_s"], fixed(2)),
               col("vs dequant+matmul", "vs dequant+matmul", times(2)),
               col("fp32 (ms)", lambda r: 1e3 * r["fp32 matmul_s"], fixed(2)),
               col("vs fp32", "vs fp32 matmul", times(2)),
               col("bnb NF4 (ms)", lambda r: 1e3 * r["bnb Linear4bit_s"] if "bnb Linear4bit_s" in r else None,
                   fixed(2)),
               col("vs bnb", "vs bnb Linear4bit", times(2))]
    parts = []
    if result["kernels"]:
        shape = result["kernels"][0]["shape"]
        parts.append(report.Part("kernels", kernels, result["kernels"],
                                 f"qlinear on a [{shape[0]}, {shape[1]}] layer; copy bandwidth "
                                 f"{result['copy_gbps']:.1f} GB/s; 'vs X' is X's time over qlinear's (> 1: qlinear "
                                 "faster)."))
    if "finetune" in result:
        parts += finetune_tables(result["finetune"])
    return parts


def plot(result: dict, path: str) -> None:
    """qlinear's time and its alternatives' against the token count, one panel per scheme; with a fine-tuning run,
    the training loss against steps (mean over seeds) of every method."""
    schemes = list(dict.fromkeys(r["scheme"] for r in result["kernels"]))
    finetune_panel = "finetune" in result
    panels = max(len(schemes) + finetune_panel, 1)
    plt, fig, axes = report.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, scheme in zip(axes[0], schemes):
        rows = [r for r in result["kernels"] if r["scheme"] == scheme]
        tokens = [r["tokens"] for r in rows]
        for key, label in [("qlinear_s", "fastdist qlinear"), ("dequant+matmul_s", "dequantize + matmul"),
                           ("fp32 matmul_s", "fp32 matmul"), ("bnb Linear4bit_s", "bitsandbytes NF4 Linear4bit")]:
            if all(key in r for r in rows):
                ax.plot(tokens, [1e3 * r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{scheme}, [{rows[0]['shape'][0]}, {rows[0]['shape'][1]}]", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if finetune_panel:
        ax = axes[0][-1]
        # each method at its chosen rate (the summary's): averaging over the grid would mix in diverged rates
        chosen = {e["method"]: e.get("lr") for e in result["finetune"].get("summary", [])}
        runs = [r for r in result["finetune"]["runs"]
                if "curve" in r and chosen.get(r["method"], r.get("lr")) == r.get("lr")]
        for method in dict.fromkeys(r["method"] for r in runs):
            curves = [r["curve"] for r in runs if r["method"] == method]
            mean = [statistics.mean(values) for values in zip(*curves)]
            ax.plot(range(1, len(mean) + 1), mean, label=f"{method} (lr {chosen.get(method)})", linewidth=1)
        ax.set_xlabel("fine-tuning step")
        ax.set_ylabel("training loss (mean over seeds, chosen rate)")
        ax.set_title("fine-tuning on pydoc topics", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fastdist adapters, {result['env']['backend']}, load {result['env'].get('loadavg', '-')}",
                 fontsize=9)
    report.save_figure(fig, path)


# ---- fine-tuning comparison ----

def _text_bytes(paths, limit):
    chunks, total = [], 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def corpora(pretrain_bytes: int = 4 << 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Byte tokens: the standard library's sources (pretraining), and pydoc's English topics split 80/10/10 into
    fine-tuning, validation (to choose the learning rate) and held-out text. Always on the machine, nothing
    downloaded."""
    import glob
    import os
    import sysconfig
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    pretrain = _text_bytes(sources, pretrain_bytes)
    from pydoc_data import topics
    prose = torch.frombuffer(bytearray("\n\n".join(topics.topics.values()).encode("utf-8", "replace")),
                             dtype=torch.uint8).long()
    val, cut = int(0.8 * prose.numel()), int(0.9 * prose.numel())
    return pretrain, prose[:val], prose[val:cut], prose[cut:]


def _batch(data, g, seq):
    starts = torch.randint(data.numel() - seq - 1, (BATCH,), generator=g)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


def _evaluate(model, held_out, seq):
    g = torch.Generator().manual_seed(1234)
    losses, correct, count = [], 0, 0
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            tokens = _batch(held_out, g, seq)
            logits = model(input_ids=tokens[:, :-1]).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item())
            correct += (logits.argmax(-1) == tokens[:, 1:]).sum().item()
            count += tokens[:, 1:].numel()
    return statistics.mean(losses), correct / count


def pretrain(steps: int, data: torch.Tensor, config: dict):
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    bar = progress(steps, "pretrain")
    for _ in range(steps):
        tokens = _batch(data, g, config["max_position_embeddings"])
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.step()
    return model.state_dict()


def _bnb_model(model):
    """model's target linears replaced by hand-built bitsandbytes NF4 Linear4bit (as QLoRA), wrapped by PEFT."""
    import bitsandbytes as bnb
    import peft
    from torch import nn
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name != "lm_head":
            layer = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=m.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(m.weight.detach().clone(), requires_grad=False, quant_type="nf4",
                                             blocksize=64)
            layer = layer.to("cpu")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
    model.is_loaded_in_4bit = True  # else PEFT wraps the 4-bit layers with its generic LoRA layer
    return model


def _build(method, state, rank, config):
    import transformers
    from fastdist import adapters
    base, adapter = FINETUNE[method]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.load_state_dict(state)
    for p in model.parameters():
        p.requires_grad_(False)
    if base == "bnb-nf4":
        import peft
        model = peft.get_peft_model(_bnb_model(model), peft.LoraConfig(r=rank, lora_alpha=rank,
                                                                       target_modules=TARGETS, lora_dropout=0.0))
        return model, [p for p in model.parameters() if p.requires_grad]
    if base != "float":
        scheme, block, block_rows = BASES[base]
        adapters.quantize_model(model, scheme, block=block, block_rows=block_rows, skip=("lm_head",))
    adapters.add_adapters(model, adapter, r=rank, target_modules=TARGETS)
    return model, adapters.adapter_parameters(model)


def _finetune_seed(methods, lrs, state, data, val, held_out, steps, seed, rank, config):
    """Fine-tunes every method at every learning rate from the same start on the same batches, interleaved step by
    step (run after run on each batch), so that the step times of all runs see the same machine load; the first step
    is warm-up."""
    import time
    from fastdist import adapters
    seq = config["max_position_embeddings"]
    runs = {}
    for method in methods:
        for lr in lrs:
            torch.manual_seed(seed)
            try:
                model, params = _build(method, state, rank, config)
            except Exception as e:  # a peer that fails here is recorded, not hidden
                runs[method, lr] = {"method": method, "lr": lr, "seed": seed, "error": f"{type(e).__name__}: {e}"}
                continue
            runs[method, lr] = {"model": model, "params": params, "opt": torch.optim.AdamW(params, lr=lr),
                                "curve": [], "times": [], "cpu_times": []}
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        tokens = _batch(data, g, seq)
        for key, run_ in runs.items():
            if "error" in run_:
                continue
            try:
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = run_["model"](input_ids=tokens, labels=tokens).loss
                run_["opt"].zero_grad(set_to_none=True)
                loss.backward()
                run_["opt"].step()
                run_["times"].append(time.perf_counter() - start)
                run_["cpu_times"].append(time.process_time() - cpu_start)
                run_["curve"].append(loss.item())
            except Exception as e:
                runs[key] = {"method": key[0], "lr": key[1], "seed": seed, "error": f"{type(e).__name__}: {e}"}
    rows = []
    for (method, lr), run_ in runs.items():
        if "error" in run_:
            rows.append(run_)
            continue
        model, params = run_["model"], run_["params"]
        model.eval()
        val_loss, _ = _evaluate(model, val, seq)
        loss, acc = _evaluate(model, held_out, seq)
        timed = run_["times"][1:] or run_["times"]
        cpu_timed = run_["cpu_times"][1:] or run_["cpu_times"]
        row = {"method": method, "lr": lr, "seed": seed, "trainable": sum(p.numel() for p in params),
               "val_loss": val_loss, "loss": loss, "acc": acc,
               "step_s": statistics.median(timed), "step_samples_s": run_["times"],
               "step_cpu_s": statistics.median(cpu_timed), "step_cpu_samples_s": run_["cpu_times"],
               "curve": run_["curve"],
               "base_bytes": sum(b.numel() * b.element_size() for b in model.buffers()) +
               sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)}
        # weights and training state: the frozen base, and per trainable float32 parameter its value, gradient and
        # AdamW's two moments (activations are the same model's for every method and left out)
        row["state_bytes"] = row["base_bytes"] + 16 * row["trainable"]
        if FINETUNE[method][0] != "bnb-nf4":
            merge_report = adapters.merge(model)
            row["merged_loss"], row["merged_acc"] = _evaluate(model, held_out, seq)
            row["merged_into"] = sorted({r["into"] for r in merge_report.values()})
        rows.append(row)
        runs[method, lr] = None  # frees the model before the next one is merged
    return rows


def _mean_std(entry: dict, rows: list[dict], keys) -> None:
    for key in keys:
        values = [r[key] for r in rows if key in r]
        if values:
            entry[key] = statistics.mean(values)
            entry[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0


def finetune(args: argparse.Namespace) -> dict:
    """Pretrains once, then fine-tunes every method at every learning rate for every seed; raw curves kept. Each
    method's summary is at its learning rate of lowest mean validation loss."""
    config = model_config(args.hidden, args.layers, args.seq)
    rank = args.rank if args.rank is not None else max(1, args.hidden // 64)
    lrs = list(dict.fromkeys(args.lrs))
    pre, data, val, held_out = corpora()
    state = pretrain(args.pretrain_steps, pre, config)
    base_rows = []
    import transformers
    from fastdist import adapters
    for base in ("float", *BASES):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model.load_state_dict(state)
        if base != "float":
            scheme, block, block_rows = BASES[base]
            adapters.quantize_model(model, scheme, block=block, block_rows=block_rows)
        model.eval()
        loss, acc = _evaluate(model, held_out, args.seq)
        base_rows.append({"base": base, "loss": loss, "acc": acc})
    runs = []
    bar = progress(len(args.seeds), "finetune")
    for seed in args.seeds:
        runs += _finetune_seed(args.methods, lrs, state, data, val, held_out, args.steps, seed, rank, config)
        bar.step(f"seed {seed}")
    summary, grid = [], []
    for method in args.methods:
        by_lr = {lr: [r for r in runs if r["method"] == method and r["lr"] == lr and "error" not in r] for lr in lrs}
        for lr, ok in by_lr.items():
            if ok:
                entry = {"method": method, "lr": lr, "seeds": len(ok)}
                _mean_std(entry, ok, ("val_loss", "loss", "acc"))
                grid.append(entry)
        tried = [lr for lr in lrs if by_lr[lr]]
        if not tried:
            summary.append({"method": method, "error": next(r["error"] for r in runs if r["method"] == method)})
            continue
        best = min(tried, key=lambda lr: statistics.mean(r["val_loss"] for r in by_lr[lr]))
        ok = by_lr[best]
        entry = {"method": method, "base": FINETUNE[method][0], "lr": best, "trainable": ok[0]["trainable"],
                 "seeds": len(ok), "state_bytes": ok[0]["state_bytes"]}
        _mean_std(entry, ok, ("val_loss", "loss", "acc", "step_s", "step_cpu_s", "merged_loss"))
        # step times over LoRA on the float base's at the same rate, seed by seed (timed in the same rounds)
        for key, name in (("step_s", "step_vs_lora_float"), ("step_cpu_s", "step_cpu_vs_lora_float")):
            reference = {(r["seed"], r["lr"]): r[key] for r in runs if r["method"] == "lora-float" and "error" not in r}
            ratios = [r[key] / reference[r["seed"], r["lr"]] for r in runs
                      if r["method"] == method and "error" not in r and (r["seed"], r["lr"]) in reference]
            if ratios:
                entry[name] = statistics.mean(ratios)
        summary.append(entry)
    return {"config": {"model": config, "seq": args.seq, "batch": BATCH, "lrs": lrs, "steps": args.steps,
                       "pretrain_steps": args.pretrain_steps, "rank": rank, "targets": TARGETS,
                       "seeds": args.seeds},
            "bases": base_rows, "summary": summary, "grid": grid, "runs": runs}


def _pm(key):
    def value(r):
        return f"{r[key]:.4f} +- {r[key + '_std']:.4f}" if key in r else None
    return value


def finetune_tables(result: dict) -> list[report.Part]:
    cfg = result["config"]
    columns = [col("method", "method"), col("base", "base"), col("trainable", "trainable", fixed(0)),
               col("lr", "lr", lambda v: f"{v:g}"), col("validation loss", _pm("val_loss"), numeric=True),
               col("held-out loss", _pm("loss"), numeric=True), col("accuracy", _pm("acc"), numeric=True),
               col("merged loss", _pm("merged_loss"), numeric=True),
               col("step (ms)", lambda r: 1e3 * r["step_s"] if "step_s" in r else None, fixed(1)),
               col("step vs lora-float", "step_vs_lora_float", times(2)),
               col("step CPU (ms)", lambda r: 1e3 * r["step_cpu_s"] if "step_cpu_s" in r else None, fixed(1)),
               col("CPU vs lora-float", "step_cpu_vs_lora_float", times(2)),
               col("weights + state (MiB)", lambda r: r["state_bytes"] / MIB if "state_bytes" in r else None,
                   fixed(2)),
               col("error", "error")]
    bases = [col("base", "base"), col("held-out loss", "loss", fixed(4)), col("accuracy", "acc", fixed(4))]
    # recordings made before the learning-rate grid have one rate, "lr", and no validation split
    lrs = cfg.get("lrs", [cfg.get("lr")])
    rate = (f"AdamW lr {lrs[0]:g}" if len(lrs) == 1 else
            f"AdamW lr grid {', '.join(f'{lr:g}' for lr in lrs)}, each method at its lowest mean validation loss")
    caption = (f"LLaMA {cfg['model']['hidden_size']}d x {cfg['model']['num_hidden_layers']} layers, byte tokens; "
               f"{cfg['pretrain_steps']} pretraining steps on stdlib sources, {cfg['steps']} fine-tuning steps on "
               f"pydoc topics (batch {cfg['batch']} x {cfg['seq']}, {rate}), adapters on "
               f"{','.join(cfg['targets'])}, budget LoRA r = {cfg['rank']}, seeds {cfg['seeds']}; mean +- std.")
    parts = [report.Part("finetune", columns, result["summary"], caption)]
    if len(result.get("grid", [])) > len(result["summary"]):
        grid = [col("method", "method"), col("lr", "lr", lambda v: f"{v:g}"),
                col("validation loss", _pm("val_loss"), numeric=True), col("held-out loss", _pm("loss"), numeric=True),
                col("accuracy", _pm("acc"), numeric=True)]
        parts.append(report.Part("grid", grid, result["grid"], "Every learning rate of the grid (mean +- std)."))
    return parts + [report.Part("bases", bases, result["bases"], "The bases before fine-tuning.")]
