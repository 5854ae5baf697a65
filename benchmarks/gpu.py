"""samba-hf on a GPU against transformers' own models, bf16, one process: the paper's Figure 2 / Table 4 measurements.

    python benchmarks/gpu.py --out out/gpu/kernels.json            # on a CUDA machine; ~2-4 minutes
    python benchmarks/gpu.py --plot out/gpu/*.json --plot-out out/gpu/figure2.png
    python benchmarks/gpu.py --table out/gpu/*.json                # Markdown for benchmarks/results/HISTORY.md
    bash benchmarks/gpu_run.sh                                      # everything, on the GPU machine (see there)

Models (random weights, bf16; speed does not depend on the weights):
    Samba-1.3B       samba-hf's "samba-1.3b" preset (18 layers, hidden 2304, window 2048)
    Llama-1.3B       transformers' Llama of the same shape (18 layers, 18 heads of 128, MLP 6144, vocab 32000), sdpa
    Mamba-2-Hybrid   samba-hf, blocks 7-13 of NVIDIA's Mamba-2-Hybrid 8B ("M-M*-M-", full width, its 256K vocab)
    NemotronH        transformers' NemotronHForCausalLM on the same layout and sizes
    Phi-4-mini-flash Phi-4-mini-flash-reasoning's released layout (SambaY, tests/data/sambay/config.json), 3.85B
    Llama-3.8B       transformers' Llama of its width, depth, heads and vocabulary, the MLP widened to 11008 so that it
                     has as many parameters (benchmarks/sambay_full_size.py's), sdpa

Measured: prefill (one forward, `logits_to_keep=1`, no cache) at --prefill lengths, tokens/s; decode tokens/s at
--decode contexts, batch 1 and --batch, from a cache filled with random states and keys/values of that context (a
step's time does not depend on them), eager (the model called step by step, as generate's loop does; Llama and
NemotronH also with sdpa kept off cuDNN's attention, as samba-hf's models keep it over a cache) and, with
--graphs, through `generate(cache_implementation="static")` with transformers' compile (CUDA graphs where it compiles)
at contexts up to --graphs-max-context (each context and batch compiles anew), with the compiled step's own device
time (`forward_ms`) beside the time to read the weights once (`weights_read`); a training step (forward and backward,
batch 1) at --train tokens/s; peak GPU memory of each. First, Samba-1.3B's sliding-window attention alone as samba-hf
computes it without flash-attn (block by block through sdpa) against sdpa over the full causal prompt and, on CUDA,
flex_attention with a sliding block mask, up to 32K: linear time, and the speed per key attended; and the Mamba conv
as the nn.Conv1d module, as 4 shifted multiply-adds and through causal-conv1d where installed. A prefill predicted
(from the last length) to take over --cap seconds is skipped, and so is everything after --time-limit, each recorded
as skipped with why; an out-of-memory is recorded as such.

Which kernels samba-hf runs is what this environment has, or what --kernels chooses through the kernel switch
(recorded under "kernels" and "kernel_implementation");
transformers' NemotronH takes mamba-ssm and causal-conv1d where they import, except with --kernels triton or none,
which keeps it on its torch path too (recorded as "nemotron_h_mamba_ssm"). benchmarks/gpu_run.sh runs it with
--kernels triton (what `pip install` gives) and, given time, with everything; --plot draws the JSON files together.
On a machine without CUDA it says so in one line and exits 1. --smoke runs the same code on tiny models on the CPU
(tests/test_benchmark_options.py runs it), so that a GPU session never discovers a bug in this file.

Checking drafts (--verify, the speculative-decoding cost): from a cache filled as for decode, batch 1, the time of a
recorded forward of --verify-tokens tokens (a current token and its drafts, the cache recording as assisted
generation has it, then a `crop` of the drafts) against one eager one-token step, median of --steps each.
"""

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from datetime import date

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, NemotronHConfig

from samba_hf import SambaConfig, SambaForCausalLM, SambaYConfig, SambaYForCausalLM, attention_samba, ssm_samba
from samba_hf.cache_samba import CACHE_NAME, cache_layer_kind, use_samba_layers

MODELS = ("Samba-1.3B", "Llama-1.3B", "Phi-4-mini-flash", "Llama-3.8B", "Mamba-2-Hybrid", "NemotronH")
RELEASE_CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "sambay", "config.json"
)
LLAMA_3_8B_MLP = 11008  # as many parameters as Phi-4-mini-flash (benchmarks/sambay_full_size.py)
HYBRID_PATTERN = "M-M*-M-"  # blocks 7-13 of the 8B's pattern


def configs(smoke: bool) -> dict:
    """The four models' configs; --smoke: the same layouts at a few hundred thousand parameters."""
    if smoke:
        samba = SambaConfig.from_preset("tiny", sliding_window=16)
        hybrid = SambaConfig.from_preset(
            "mamba2-hybrid-8b",
            hybrid_override_pattern=HYBRID_PATTERN,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            mamba_d_state=8,
            mamba2_head_dim=16,
            mamba2_n_groups=2,
            mamba_expand=2,
            mamba2_chunk_size=16,
        )
    else:
        samba = SambaConfig.from_preset("samba-1.3b")
        hybrid = SambaConfig.from_preset("mamba2-hybrid-8b", hybrid_override_pattern=HYBRID_PATTERN)
    llama = LlamaConfig(
        vocab_size=samba.vocab_size,
        hidden_size=samba.hidden_size,
        intermediate_size=samba.intermediate_size,
        num_hidden_layers=samba.num_hidden_layers,
        num_attention_heads=samba.num_attention_heads,
        num_key_value_heads=samba.num_key_value_heads,
        head_dim=samba.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
        attn_implementation="sdpa",
    )
    c = hybrid
    nemotron = NemotronHConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        hybrid_override_pattern=HYBRID_PATTERN,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        mlp_hidden_act="gelu",
        ssm_state_size=c.mamba_d_state,
        mamba_num_heads=c.mamba2_num_heads,
        mamba_head_dim=c.mamba2_head_dim,
        n_groups=c.mamba2_n_groups,
        conv_kernel=c.mamba_d_conv,
        chunk_size=c.mamba2_chunk_size,
        layer_norm_epsilon=c.rms_norm_eps,
        tie_word_embeddings=False,
        use_bias=False,
        use_conv_bias=True,
        attention_bias=False,
        mlp_bias=False,
        residual_in_fp32=False,
        attn_implementation="sdpa",
    )
    with open(RELEASE_CONFIG) as f:
        released = json.load(f)
    if smoke:
        released.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        released.update(num_hidden_layers=8, vocab_size=512, sliding_window=16, pad_token_id=0)
        released.update(bos_token_id=0, eos_token_id=0)
    sambay = SambaYConfig.from_dict(released)
    llama_3_8b = LlamaConfig(
        vocab_size=sambay.vocab_size,
        hidden_size=sambay.hidden_size,
        intermediate_size=128 if smoke else LLAMA_3_8B_MLP,
        num_hidden_layers=sambay.num_hidden_layers,
        num_attention_heads=sambay.num_attention_heads,
        num_key_value_heads=sambay.num_key_value_heads,
        head_dim=sambay.hidden_size // sambay.num_attention_heads,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
        attn_implementation="sdpa",
    )
    return {
        "Samba-1.3B": samba,
        "Llama-1.3B": llama,
        "Phi-4-mini-flash": sambay,
        "Llama-3.8B": llama_3_8b,
        "Mamba-2-Hybrid": hybrid,
        "NemotronH": nemotron,
    }


def build(name: str, config, device, dtype):
    from transformers import NemotronHForCausalLM  # (imported here: after `hide_kernel_packages`, where it runs)

    torch.manual_seed(0)
    transformers_models = {
        "Llama-1.3B": LlamaForCausalLM,
        "Llama-3.8B": LlamaForCausalLM,
        "NemotronH": NemotronHForCausalLM,
    }
    cls = transformers_models.get(name, SambaYForCausalLM if name == "Phi-4-mini-flash" else SambaForCausalLM)
    ours = cls in (SambaForCausalLM, SambaYForCausalLM)
    if ours:
        config._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(config)
    model = model.to(dtype).eval()
    if ours:
        model.set_kernel_implementation(KERNEL_SWITCH[KERNELS])  # --kernels, through the public switch
    return model


def filled_cache(model, batch: int, context: int) -> DynamicCache:
    """A cache as after `context` tokens: random Mamba states and keys/values (a sliding layer keeps window - 1)."""
    config, device, dtype = model.config, model.device, model.dtype
    cache = DynamicCache(config=config)
    if isinstance(model, (SambaForCausalLM, SambaYForCausalLM)):
        use_samba_layers(cache)  # samba-hf's in-place window and Mamba layers, as its forward sets up
    for i, layer in enumerate(cache.layers):
        kind = cache_layer_kind(layer)
        block = model.model.layers[i]
        if kind == "linear_attention":
            mixer = getattr(block, "mamba", None) or getattr(block, "mixer", None) or block.attn  # (SambaY's: attn)
            kernel = mixer.conv1d.kernel_size[0]
            cache.update_conv_state(
                torch.randn(batch, mixer.conv1d.in_channels, kernel, device=device, dtype=dtype),
                i,
                conv_kernel_size=kernel,
            )
            shape = (mixer.num_heads, mixer.head_dim) if hasattr(mixer, "num_heads") else (mixer.intermediate_size,)
            cache.update_recurrent_state(
                torch.randn(batch, *shape, mixer.ssm_state_size, device=device, dtype=torch.float32), i
            )
        elif kind in ("sliding_attention", "full_attention"):
            length = context if kind == "full_attention" else min(context, config.sliding_window - 1)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            kv = torch.randn(batch, config.num_key_value_heads, length, head_dim, device=device, dtype=dtype)
            cache.update(kv, kv.clone(), i)
    return cache


class Timer:
    """Seconds of GPU work between entering and leaving (synchronised), and the peak memory meanwhile, in GiB."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        else:
            self.peak_gib = None
        self.seconds = time.perf_counter() - self.start


def timed(fn) -> float:
    """Seconds of one call of fn, after a warm-up call (first launches, compiles)."""
    fn()
    with Timer() as t:
        fn()
    return t.seconds


def attempt(fn):
    """fn()'s result, or {"error": ...}: out of memory, or anything a path cannot do (recorded, not fatal). A CUDA
    error that poisons the process (an illegal memory access: on the H200, transformers' NemotronH with mamba-ssm at
    128K) ends the run's measuring, the JSON still written (`skip_reason`)."""
    global BROKEN
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as error:  # a path that fails is a result too
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
    finally:
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except Exception as error:  # the CUDA context is gone: nothing more can run in this process
                BROKEN = f"the CUDA context was lost ({type(error).__name__}: {str(error).splitlines()[0][:200]})"


BROKEN = None


def prefill(model, length: int, repeat: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)
    best, peak = float("inf"), 0.0
    with torch.no_grad():
        # warm-up at this very length: the kernels' first launch at these shapes, and (past the window)
        # flex_attention's compile for this length's bucket. (The H100 run of 2026-11-26 warmed up at 4K only, and its
        # one timed run at 128K held the compile: 11.2 s where 32K took 0.33 s.)
        model(ids, use_cache=False, logits_to_keep=1)
        for _ in range(repeat):
            with Timer() as t:
                model(ids, use_cache=False, logits_to_keep=1)
            best, peak = min(best, t.seconds), max(peak, t.peak_gib or 0.0)
    return {"seconds": best, "tokens_per_s": length / best, "peak_gib": peak}


@torch.no_grad()
def eager_decoder(model, context: int, batch: int):
    """`run(n)`: n more eager greedy decoding steps of `batch` sequences, on a cache as after `context` tokens (call it
    under no_grad), after two warm-up steps taken here (first calls' allocations and launches: the first H200 run's 1K
    rows had them)."""
    cache = filled_cache(model, batch, context)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    at = 0

    def run(steps: int):
        nonlocal token, at
        for _ in range(steps):
            position = torch.full((batch, 1), context + at, device=model.device)
            step = model(token, **{CACHE_NAME: cache}, use_cache=True, position_ids=position)  # (5.24's name: cache)
            token = step.logits[:, -1:].argmax(-1)
            at += 1

    run(2)
    return run


@torch.no_grad()
def verify(model, context: int, tokens: int, steps: int) -> dict:
    """What checking drafts costs: a recorded forward of `tokens` tokens (the current one and tokens - 1 drafts, the
    cache recording as assisted generation has it) and the `crop` that takes every draft back, against one eager
    one-token step, batch 1, from a cache as after `context` tokens; medians of `steps` each (after a warm-up)."""
    device = model.device
    cache = filled_cache(model, 1, context)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    at = context

    def step(n):
        nonlocal at
        position = torch.arange(at, at + n, device=device)[None]
        model(ids[:, :n], **{CACHE_NAME: cache}, use_cache=True, position_ids=position, logits_to_keep=n)
        if n > 1:
            cache.crop(-(n - 1))  # every draft refused: the cache one token on, as after a one-token step
        at += 1

    def median_ms(n):
        times = []
        for i in range(steps + 2):
            with Timer() as t:
                step(n)
            if i >= 2:
                times.append(1000 * t.seconds)
        return sorted(times)[len(times) // 2]

    one = median_ms(1)
    cache.activate_past_recording()
    checked = median_ms(tokens)
    return {"one_step_ms": one, "check_ms": checked, "check_in_steps": checked / one, "tokens": tokens}


def sdpa_without_cudnn():
    """sdpa's other backends, not cuDNN's attention, which builds a graph for each new key length (what samba-hf's
    models do over a cache, `attention_samba.sdpa_backends`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decode_eager(model, context: int, batch: int, steps: int, cudnn: bool = True) -> dict:
    """cudnn=False: `sdpa_without_cudnn`; for transformers' models, the baseline that is not slowed by cuDNN's
    graphs (docs/speed.md)."""
    with contextlib.nullcontext() if cudnn else sdpa_without_cudnn():
        run = eager_decoder(model, context, batch)
        with torch.no_grad(), Timer() as t:
            run(steps)
    return {"tokens_per_s": batch * steps / t.seconds, "ms_per_step": 1000 * t.seconds / steps, "peak_gib": t.peak_gib}


def decode_graphs(model, context: int, batch: int, steps: int) -> dict:
    """Through generate with a static cache, which transformers compiles on CUDA (CUDA graphs, "reduce-overhead");
    the step time from a logits processor's timestamps, after two warm-up steps (generate's own work between steps
    included); and the compiled step's own time, "forward_ms": on a GPU between two events recorded around each call
    of the compiled forward (the replay's device time, #32's "a step within 2x of the time to read the weights
    once", against `weights_read`), the median after two warm-up steps; None where generate did not compile."""
    from transformers import LogitsProcessor, LogitsProcessorList

    calls = []  # each compiled call's (start, end) CUDA events, or its ms on a CPU
    get_compiled_call = model.get_compiled_call

    def timed_compiled_call(compile_config):
        compiled = get_compiled_call(compile_config)

        def call(*args, **kwargs):
            if not torch.cuda.is_available():
                begun = time.perf_counter()
                out = compiled(*args, **kwargs)
                calls.append(1000 * (time.perf_counter() - begun))
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = compiled(*args, **kwargs)
            end.record()
            calls.append((start, end))
            return out

        return call

    class Stamps(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=model.device)
    stamps = Stamps()
    model.get_compiled_call = timed_compiled_call  # (generate asks for the compiled forward once per call)
    try:
        with Timer() as t:
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=steps + 3,
                min_new_tokens=steps + 3,
                do_sample=False,
                cache_implementation="static",
                logits_processor=LogitsProcessorList([stamps]),
                pad_token_id=0,
            )
    finally:
        del model.get_compiled_call  # the class's method again
    step = (stamps.times[-1] - stamps.times[2]) / (len(stamps.times) - 3)  # after the prompt and two warm-up steps
    own = sorted(call if isinstance(call, float) else call[0].elapsed_time(call[1]) for call in calls[2:])
    return {
        "tokens_per_s": batch / step,
        "ms_per_step": 1000 * step,
        "peak_gib": t.peak_gib,
        "compiled": getattr(model, "_compiled_call", None) is not None,
        "forward_ms": own[len(own) // 2] if own else None,
    }


def weights_read(model) -> dict:
    """How long reading the model's weights once takes here: their bytes over the memory bandwidth a large copy
    reaches (bytes read and written), #32's yardstick for a decoding step in CUDA graphs."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer = torch.empty(2**28 if model.device.type == "cuda" else 2**22, device=model.device)  # 1 GiB; 16 MiB
    copy = torch.empty_like(buffer)
    copy.copy_(buffer)
    with Timer() as t:
        for _ in range(5):
            copy.copy_(buffer)
    bandwidth = 5 * 2 * buffer.numel() * buffer.element_size() / t.seconds
    return {
        "weights_gib": weight_bytes / 2**30,
        "copy_gb_per_s": bandwidth / 1e9,
        "weights_read_ms": 1000 * weight_bytes / bandwidth,
    }


def train_step(model, length: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)
    model.train()
    try:
        model(ids, labels=ids).loss.backward()  # warm-up at this length (compiles; the H100 run of 2026-11-26 warmed
        # up at 256 tokens, and Samba's timed 4K step held the first run at 4K, flex_attention's compile among it:
        # 9.6 s, Llama's 0.22 s)
        model.zero_grad(set_to_none=True)
        with Timer() as t:
            model(ids, labels=ids).loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return {"tokens_per_s": length / t.seconds, "seconds": t.seconds, "peak_gib": t.peak_gib}


# --kernels, as the kernel switch (`kernel_implementation`) names it: the models take it; the micro-benchmarks compare
# every installed kernel whatever it is (the H100 run of 2026-11-26 compared samba-hf's Triton scan with nothing,
# mamba-ssm being hidden by --kernels triton).
KERNEL_SWITCH = {"all": "auto", "triton": "samba", "none": "pytorch"}
KERNELS = "all"


def installed_kernels():
    """What the micro-benchmarks compare: every kernel installed."""
    return ssm_samba.load_kernels()


KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")


def hide_kernel_packages():
    """Keep transformers' NemotronH on its torch path, as --kernels triton / none keeps samba-hf's models off the
    packages (#32 compares the Mamba-2-Hybrid with NemotronH's torch path): NemotronH takes mamba-ssm and
    causal-conv1d wherever they import, deciding when its modeling file is imported, so they are made unimportable
    before that. The micro-benchmarks still compare the packages' kernels, which samba-hf's loader found before
    (`installed_kernels`). The H100 run of 2026-11-26 ran NemotronH on mamba-ssm in its `--kernels triton` run."""
    if "transformers.models.nemotron_h.modeling_nemotron_h" in sys.modules:
        raise RuntimeError("transformers' NemotronH was imported before the kernel packages were hidden from it")
    for name in KERNEL_PACKAGES:
        sys.modules[name] = None  # `import name` now raises ImportError


def kernels_present() -> dict:
    """What this environment has: each samba-hf kernel, and whether flash-attn imports."""
    import importlib
    import importlib.util

    found = ssm_samba.load_kernels()
    present = {name: getattr(found, name) is not None for name in ssm_samba.Kernels._fields[:-1]}
    present["flash_attn"] = importlib.util.find_spec("flash_attn") is not None
    try:  # what transformers' NemotronH takes: it imports mamba_ssm (the whole package) when it is imported
        importlib.import_module("mamba_ssm")
        present["nemotron_h_mamba_ssm"] = True
    except Exception:
        present["nemotron_h_mamba_ssm"] = False
    return present


def measure(args, device) -> dict:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    result = {
        "command": "python benchmarks/gpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": date.today().isoformat(),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "label": args.label,
        "kernels": kernels_present(),
        "kernel_implementation": KERNEL_SWITCH[KERNELS],
        "models": {},
    }
    if args.micro:
        result["sliding_attention"] = sliding_attention(args, device, dtype)
        result["mamba_conv"] = mamba_conv(args, device, dtype)
        result["mamba_scan"] = mamba_scan(args, device, dtype)
        result["scan_configs"] = scan_configs(args, device, dtype)
    chosen = {name: config for name, config in configs(args.smoke).items() if name in args.models.split(",")}
    for name in chosen:
        result["models"][name] = {"prefill": {}, "decode": {}, "train": {}}
    # Phase by phase, every model in each (one in memory at a time), so that a run cut short by --time-limit has
    # every model's prefill and eager decode before the slow compiles of the graphs phase.
    for phase in PHASES:
        if (phase == "graphs" and not args.graphs) or (phase == "verify" and not args.verify_tokens):
            continue
        for name, config in chosen.items():
            if skip_reason(args):
                continue
            model = build(name, config, device, dtype)
            row = result["models"][name]
            row["parameters"] = sum(p.numel() for p in model.parameters())
            PHASES[phase](args, name, model, row)
            # which path Samba's long sliding-window prompts took: flex_attention, or block-wise where it failed
            result["flex_attention_works"] = {
                str(key): ok for key, ok in attention_samba._FLEX_ATTENTION_WORKS.items()
            }
            del model
            if args.out:  # so that a run cut short keeps what it measured
                write_json(args.out, result)
    return result


def prefill_phase(args, name, model, row):
    previous = None  # (length, seconds) of the last prefill that ran
    for length in ints(args.prefill):
        why = skip_reason(args, previous and previous[1] * length / previous[0])
        if why:
            row["prefill"][length] = {"skipped": why}
            continue
        repeat = args.repeat if length < 32768 else 1
        row["prefill"][length] = attempt(lambda: prefill(model, length, repeat))
        seconds = row["prefill"][length].get("seconds")
        previous = (length, seconds) if seconds is not None else (1, float("inf"))
        report(name, f"prefill {length}", row["prefill"][length])


def decode_phase(args, name, model, row):
    for context in ints(args.decode):
        full = None  # a batch that ran out of memory: larger ones are skipped
        for batch in sorted({1, *ints(args.batch)}):
            why = skip_reason(args) or (full and f"batch {full} ran out of memory")
            entry = row["decode"].setdefault(f"{context}x{batch}", {})
            entry["eager"] = (
                {"skipped": why} if why else attempt(lambda: decode_eager(model, context, batch, args.steps))
            )
            report(name, f"decode {context}x{batch} eager", entry["eager"])
            if entry["eager"].get("error") == "out of memory":
                full = batch
            if name in BASELINES.values() and not skip_reason(args) and "tokens_per_s" in entry["eager"]:
                entry["eager_no_cudnn"] = attempt(lambda: decode_eager(model, context, batch, args.steps, cudnn=False))
                report(name, f"decode {context}x{batch} eager, sdpa without cuDNN", entry["eager_no_cudnn"])
    if not skip_reason(args):
        # at key lengths no timed step had: the H100 run of 2026-11-26 profiled lengths its timed steps had made
        # (cuDNN's graphs for them built already), and its profile missed what the timed steps paid
        # (a timed decode's steps reach context + 2 + steps)
        row["decode_profile"] = attempt(lambda: decode_profile(model, ints(args.decode)[0] + args.steps + 2))


def decode_profile(model, context: int, steps: int = 3) -> dict:
    """Where an eager decoding step's time goes (batch 1, after warm-up steps): torch.profiler's top operators by
    self CPU time and by self device time, and the host-device synchronisations per step (each one stops the host
    from running ahead of the GPU); the profiled steps' wall time; 8 steps timed one by one (steady, or spikes);
    the same steps with sdpa kept off cuDNN; every attention operator and kernel the steps ran (which of sdpa's
    backends each model's attention took); and Python's own profile (cProfile) of the steps, by time inside each
    function. On the H100 (2026-11-26) eager steps took 47-74 ms where the operators' host and device time came to a
    few ms (Samba at 1K, Llama, samba-hf's Mamba-2-Hybrid; NemotronH 8 ms, Samba at 64K 16 ms): these say where the
    rest goes. Every step here has a key length of its own, as a timed step does."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    run = eager_decoder(model, context, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as trace, Timer() as profiled:
        run(steps)
    events = trace.key_averages()
    device_time = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def top(key):
        ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:12]
        return [[e.key, round(getattr(e, key, 0) / steps / 1000, 4), round(e.count / steps, 1)] for e in ranked]

    def per_step(*names):
        return sum(e.count for e in events if any(name in e.key for name in names)) / steps

    # which of sdpa's kernels each attention call took (cuDNN's builds a graph per new key length; the H100 run's top
    # 12 operators showed it for Samba and Llama and could not show what NemotronH's and the hybrid's took): each
    # operator and kernel named for attention, as [name, device ms, count] per step (cuDNN's attention operator is
    # aten::_cudnn_attention_forward, its kernels "..._sdpa_..."; "cudnn" alone would take in cuDNN's convolutions)
    attention = [
        [e.key, round(getattr(e, device_time, 0) / steps / 1000, 4), round(e.count / steps, 1)]
        for e in events
        if any(word in e.key.lower() for word in ("attention", "sdp", "fmha", "flash"))
    ]

    one_by_one = []
    for _ in range(8):
        with torch.no_grad(), Timer() as t:
            run(1)
        one_by_one.append(round(1000 * t.seconds, 3))
    with torch.no_grad(), sdpa_without_cudnn():
        run(2)  # first calls on these backends
        with Timer() as t:
            run(steps)
    without_cudnn = 1000 * t.seconds / steps
    python = cProfile.Profile()
    with torch.no_grad():
        python.enable()
        run(steps)
        python.disable()
    stats = pstats.Stats(python).stats  # {(file, line, function): (calls, primitive, tottime, cumtime, callers)}
    by_self = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:15]
    return {
        "ms_per_step_cpu_by_op": top("self_cpu_time_total"),
        "ms_per_step_device_by_op": top(device_time),
        "values_read_on_host_per_step": per_step("aten::_local_scalar_dense", "aten::tolist"),
        "synchronize_calls_per_step": per_step("Synchronize"),
        "ops_per_step": per_step(""),
        "attention_ops_per_step": attention,
        "profiled_ms_per_step": 1000 * profiled.seconds / steps,
        "ms_of_8_steps_one_by_one": one_by_one,
        "ms_per_step_sdpa_without_cudnn": without_cudnn,
        "python_ms_per_step_by_function": [
            [
                f"{os.path.basename(file)}:{line} {function}",
                round(1000 * value[2] / steps, 3),
                round(value[0] / steps, 1),
            ]
            for (file, line, function), value in by_self
        ],
    }


VERIFIED = ("Samba-1.3B", "Llama-1.3B", "Phi-4-mini-flash", "Llama-3.8B")  # the models checking drafts is timed on


def verify_phase(args, name, model, row):
    if name not in VERIFIED:
        return
    for context in ints(args.decode):
        why = skip_reason(args)
        entry = {"skipped": why} if why else attempt(lambda: verify(model, context, args.verify_tokens, args.steps))
        row.setdefault("verify", {})[context] = entry
        report(name, f"verify {args.verify_tokens} at {context}", entry)


def train_phase(args, name, model, row):
    for length in ints(args.train):
        why = skip_reason(args)
        row["train"][length] = {"skipped": why} if why else attempt(lambda: train_step(model, length))
        report(name, f"train {length}", row["train"][length])


def graphs_phase(args, name, model, row):
    for context in ints(args.decode):
        for batch in sorted({1, ints(args.batch)[0]}):  # (each batch compiles anew)
            if context > args.graphs_max_context or skip_reason(args):
                continue
            entry = row["decode"].setdefault(f"{context}x{batch}", {})
            if "weights_read" not in row:
                row["weights_read"] = attempt(lambda: weights_read(model))
                report(name, "weights read once", row["weights_read"])
            entry["graphs"] = attempt(lambda: decode_graphs(model, context, batch, args.steps))
            report(name, f"decode {context}x{batch} graphs", entry["graphs"])
            if "error" in entry["graphs"]:
                return  # one failure says it for the rest


def attention_lengths(args) -> list[int]:
    return [n for n in ints(args.prefill) if n <= 32768]


def sliding_attention(args, device, dtype) -> dict:
    """One Samba-1.3B attention layer's sliding-window attention on a prompt, as samba-hf computes it without
    flash-attn (`sliding_window_attention_blockwise`, sdpa per block of queries), against torch's sdpa over the full
    causal prompt (flash where the GPU has it): seconds and keys attended per second at each length."""
    from types import SimpleNamespace

    from samba_hf.attention_samba import sliding_window_attention_blockwise

    config = configs(args.smoke)["Samba-1.3B"]
    heads, head_dim, window = config.num_attention_heads, config.head_dim, config.sliding_window
    module = SimpleNamespace(num_key_value_groups=1)

    @torch.no_grad()
    def measure(length):
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device, dtype=dtype) for _ in range(3))
        window_s = timed(lambda: sliding_window_attention_blockwise(module, q, k, v, None, window, head_dim**-0.5))
        full_s = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        keys = sum(min(i + 1, window) for i in range(length))  # (query, key) pairs each computes that count
        row = {
            "window_seconds": window_s,
            "full_causal_seconds": full_s,
            "window_keys_per_s": keys / window_s,
            "full_causal_keys_per_s": length * (length + 1) / 2 / full_s,
        }
        if device.type == "cuda":  # the other candidate without flash-attn: flex_attention with a sliding mask
            flex = attempt(lambda: flex_sliding_window(q, k, v, window, keys))
            row.update({("flex_error" if name == "error" else name): value for name, value in flex.items()})
        return row

    return at_each_length(args, "attention", measure)


def flex_sliding_window(q, k, v, window: int, keys: int) -> dict:
    """torch's flex_attention over the same prompt with a sliding-window block mask, compiled for this length (the
    first call, timed apart): what issue #32 compares the block-wise sdpa path with."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = q.shape[2]

    def sliding(b, h, query, key):
        return (key <= query) & (query - key < window)

    start = time.perf_counter()
    mask = create_block_mask(sliding, None, None, length, length, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    compiled(q, k, v, block_mask=mask)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    with Timer() as t:
        compiled(q, k, v, block_mask=mask)
    return {"flex_seconds": t.seconds, "flex_keys_per_s": keys / t.seconds, "flex_compile_seconds": compile_s}


def mamba_conv(args, device, dtype) -> dict:
    """Samba-1.3B's Mamba conv (depthwise, 4 taps, over d_inner channels laid out as the mixer has them) at each
    length up to 32K: the nn.Conv1d module (what ran without causal-conv1d until samba-hf's Triton conv), samba-hf's
    4 shifted multiply-adds (the CPU path), samba-hf's Triton conv and causal-conv1d where installed; seconds."""
    from samba_hf.ssm_samba import depthwise_causal_conv

    config = configs(args.smoke)["Samba-1.3B"]
    channels, taps = config.mamba_d_inner, config.mamba_d_conv
    conv = torch.nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1, device=device, dtype=dtype)
    found = installed_kernels()

    @torch.no_grad()
    def measure(length):
        x = torch.randn(1, length, channels, device=device, dtype=dtype).transpose(1, 2)  # (1, d, L), channels last
        row = {
            "conv1d_seconds": timed(lambda: conv(x)[..., :length]),
            "shifted_adds_seconds": timed(lambda: depthwise_causal_conv(conv.weight[:, 0], conv.bias, x, length)),
        }
        if found.causal_conv1d_fn is not None:
            row["causal_conv1d_seconds"] = timed(
                lambda: found.causal_conv1d_fn(x.contiguous(), conv.weight[:, 0], conv.bias, activation=None)
            )
        if found.causal_conv_triton is not None:
            row["triton_conv_seconds"] = timed(
                lambda: found.causal_conv_triton(x, conv.weight[:, 0], conv.bias, length)
            )
        return row

    return at_each_length(args, "conv", measure)


def scan_inputs(args, device, dtype, length: int) -> dict:
    """One Mamba layer's scan inputs at this length, seeded: {"samba": ([u, dt, B, C, z], A, D)} for Samba-1.3B's
    layer (d_inner channels, d_state states, the gate) and {"mamba2": ([x, dt, B, C], A, D)} for the
    Mamba-2-Hybrid's (heads x head_dim, groups, d_state); the tensors that can take gradients first."""
    chosen = configs(args.smoke)
    samba, hybrid = chosen["Samba-1.3B"], chosen["Mamba-2-Hybrid"]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g)

    d, n = samba.mamba_d_inner, samba.mamba_d_state
    heads, p, groups, m = hybrid.mamba2_num_heads, hybrid.mamba2_head_dim, hybrid.mamba2_n_groups, hybrid.mamba_d_state
    return {
        "samba": (
            [
                randn(1, length, d).to(dtype),
                torch.nn.functional.softplus(randn(1, length, d) - 4).to(dtype),
                randn(1, length, n).to(dtype),
                randn(1, length, n).to(dtype),
                randn(1, length, d).to(dtype),
            ],
            -torch.rand(d, n, device=device, generator=g) * 16,
            torch.ones(d, device=device),
        ),
        "mamba2": (
            [
                randn(1, length, heads, p).to(dtype),
                torch.nn.functional.softplus(randn(1, length, heads) - 4),
                randn(1, length, groups, m).to(dtype),
                randn(1, length, groups, m).to(dtype),
            ],
            -torch.rand(heads, device=device, generator=g) * 16,
            torch.ones(heads, device=device),
        ),
    }


def mamba_scan(args, device, dtype) -> dict:
    """One Mamba layer's scan at each length up to 32K, through `ssm_samba.selective_scan` / `ssd_scan` as the models
    call them, once with each scan installed (whatever --kernels leaves the models): samba-hf's Triton scan,
    mamba-ssm's kernel (the CUDA scan; `mamba_chunk_scan_combined` for Mamba-2), and the PyTorch scan (Mamba-1's a
    Python step per token: up to 4K only; with --smoke, on a CPU, its CPU scan); seconds for the forward (no
    autograd), and for forward and backward at 4K.
    Samba-1.3B's layer ("samba": d_inner channels, d_state states, the gate) and the Mamba-2-Hybrid's ("mamba2":
    heads x head_dim, groups, d_state). Where the scans go in a prefill, and how samba-hf's Triton scan stands against
    mamba-ssm's (#32 asks for within 1.2x)."""
    hybrid = configs(args.smoke)["Mamba-2-Hybrid"]
    found = installed_kernels()
    only = {"triton": "samba", "mamba_ssm": "mamba_ssm", "pytorch": "pytorch"}  # row name: the switch's choice
    available = {
        "samba": {"triton": found.selective_scan_triton, "mamba_ssm": found.selective_scan_fn},
        "mamba2": {"triton": found.ssd_scan_triton, "mamba_ssm": found.mamba_chunk_scan_combined},
    }

    def scan(kind, leaves, A, D, kernel):
        if kind == "samba":
            u, dt, B, C, z = leaves
            return ssm_samba.selective_scan(u, dt, A, B, C, D, z, kernel=kernel)[0]
        x, dt, B, C = leaves
        return ssm_samba.ssd_scan(x, dt, A, B, C, D, chunk_size=hybrid.mamba2_chunk_size, kernel=kernel)[0]

    def measure(length):
        inputs = scan_inputs(args, device, dtype, length)
        row = {}
        for kind, (tensors, A, D) in inputs.items():
            for name, kernel in only.items():
                present = available[kind].get(name, True)
                if present is None or (kind == "samba" and name == "pytorch" and length > 4096 and not args.smoke):
                    continue
                with torch.no_grad():
                    row[f"{kind}_{name}_seconds"] = timed(lambda: scan(kind, tensors, A, D, kernel))
                if length == min(4096, max(attention_lengths(args))):
                    leaves = [t.detach().requires_grad_() for t in tensors]
                    row[f"{kind}_{name}_train_seconds"] = timed(
                        lambda: scan(kind, leaves, A, D, kernel).float().sum().backward()
                    )
        return row

    return at_each_length(args, "scan", measure)


# The alternatives to samba-hf's Triton scan launch that `scan_configs` times: (name, {constant of triton_scan_samba
# or, for the choice of the chunked SSD, ssm_samba: value}); the first is the default.
SCAN_CONFIGS = [
    ("default", {}),
    ("a token a step (the H100 run's kernel)", {"TILE_MAX": 1}),
    ("8 tokens a step", {"TILE_ELEMENTS": 4096}),
    ("8 tokens a step, 8 warps", {"TILE_ELEMENTS": 4096, "NUM_WARPS": 8}),
    ("16 tokens of 16 channels a step, 8 warps", {"TILE_ELEMENTS": 4096, "BLOCK_D_MAX": 16, "NUM_WARPS": 8}),
    ("16 tokens a step, no segments", {"TILE_ELEMENTS": 8192, "NUM_WARPS": 8, "MIN_SEGMENT": 1 << 30}),
    ("Mamba-2 by the scan, not the chunked SSD (the H100 run's)", {"SSD_MIN_TOKENS": 1 << 30}),
    ("chunked SSD: chunks of 64", {"SSD_CHUNK": 64}),
    ("chunked SSD: 32 channels a program (the default before the H200 run of 2026-11-28)", {"SSD_BLOCK_P": 32}),
    ("chunked SSD: 16 channels a program, 4 warps", {"SSD_BLOCK_P": 16, "SSD_NUM_WARPS": 4}),
    ("16 channels a program", {"BLOCK_D_MAX": 16}),
    ("8 channels a program", {"BLOCK_D_MAX": 8}),
    ("1 warp", {"NUM_WARPS": 1}),
    ("2 warps", {"NUM_WARPS": 2}),
    ("8 warps", {"NUM_WARPS": 8}),
    ("segments of 128, 16 programs an SM", {"MIN_SEGMENT": 128, "PROGRAMS_PER_SM": 16}),
    (
        "segments of 256, 8 programs an SM (the default before the H200 run of 2026-11-28)",
        {"MIN_SEGMENT": 256, "PROGRAMS_PER_SM": 8},
    ),
    ("segments of 512, 4 programs an SM", {"MIN_SEGMENT": 512, "PROGRAMS_PER_SM": 4}),
]


def scan_configs(args, device, dtype) -> dict:
    """samba-hf's Triton scan (forward, inference) under each launch of `SCAN_CONFIGS`, on Samba-1.3B's layer and the
    Mamba-2-Hybrid's, at the micro-benchmarks' lengths: seconds, and the largest difference from the default's
    output (the choice must not change the numbers beyond rounding); at 4K Samba's forward and backward too. What
    the defaults of triton_scan_samba.py should be; the H100 run found the forward at 4K 1.28 ms a layer (a token a
    step), 25x what reading and writing its tensors takes."""
    found = installed_kernels()
    if found.selective_scan_triton is None:
        return {"skipped": "samba-hf's Triton scan is not available here"}
    from samba_hf import triton_scan_samba

    def owner(constant):
        return triton_scan_samba if hasattr(triton_scan_samba, constant) else ssm_samba

    def ssd(x, dt, A, B, C, D):  # as the models call it: the chunked SSD or the scan, as ssm_samba decides
        return ssm_samba.ssd_scan(x, dt, A, B, C, D, kernel="samba")[0]

    def measure(length):
        inputs = scan_inputs(args, device, dtype, length)
        (u, dt, B, C, z), A, D = inputs["samba"]
        (x, dt2, B2, C2), A2, D2 = inputs["mamba2"]
        calls = {
            "samba": lambda: found.selective_scan_triton(u, dt, A, B, C, D, z)[0],
            "mamba2": lambda: ssd(x, dt2, A2, B2, C2, D2),
        }
        row, reference = {}, {}
        for name, values in SCAN_CONFIGS:
            saved = {key: getattr(owner(key), key) for key in values}
            # a launch that fails to compile leaves its dtype to the scan (ssm_samba's record of it): for that
            # launch only, not for the next ones or the models measured after
            chunked_ssd = {
                key: set(getattr(ssm_samba, key)) for key in ("_CHUNKED_SSD_FAILED", "_CHUNKED_SSD_CHECKED")
            }
            try:
                for key, value in values.items():
                    setattr(owner(key), key, value)
                for kind, call in calls.items():
                    with torch.no_grad():
                        seconds = timed(call)
                        out = call().float()
                    reference.setdefault(kind, out)
                    row[f"{kind} {name}"] = {
                        "seconds": seconds,
                        "difference": (out - reference[kind]).abs().max().item(),
                    }
                if length == min(4096, max(attention_lengths(args))):  # the backward takes the same tiles
                    leaves = [t.detach().requires_grad_() for t in (u, dt, B, C, z)]
                    row[f"samba {name}"]["train_seconds"] = timed(
                        lambda: (
                            found.selective_scan_triton(leaves[0], leaves[1], A, leaves[2], leaves[3], D, leaves[4])[0]
                            .float()
                            .sum()
                            .backward()
                        )
                    )
            finally:
                for key, value in saved.items():
                    setattr(owner(key), key, value)
                for key, value in chunked_ssd.items():
                    setattr(ssm_samba, key, value)
        return row

    return at_each_length(args, "scan configs", measure)


def at_each_length(args, what: str, measure) -> dict:
    """{length: measure(length)} at the micro-benchmarks' lengths (`attention_lengths`), each reported as it comes;
    past --time-limit a length is skipped, and a failure is recorded in its row (`attempt`)."""
    rows = {}
    for length in attention_lengths(args):
        if skip_reason(args):
            rows[length] = {"skipped": skip_reason(args)}
            continue
        rows[length] = attempt(lambda: measure(length))
        report(what, f"length {length}", rows[length])
    return rows


PHASES = {
    "prefill": prefill_phase,
    "decode": decode_phase,
    "verify": verify_phase,
    "train": train_phase,
    "graphs": graphs_phase,
}


def skip_reason(args, predicted_seconds=None) -> str | None:
    """Why a measurement is skipped: the run is past --time-limit, or the prefill, scaled from the last length that
    ran, would take over --cap seconds."""
    if BROKEN:
        return BROKEN
    if time.perf_counter() - START > args.time_limit:
        return f"past --time-limit {args.time_limit:g} s"
    if predicted_seconds is not None and predicted_seconds > args.cap:
        return f"predicted {predicted_seconds:.3g} s from the last length, over --cap {args.cap:g} s"
    return None


START = time.perf_counter()


def report(name, what, values):
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
    print(f"{name:>15} {what:<22} {shown}", flush=True)


def write_json(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(partial, path)


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from mamba2_hybrid import machine  # the CPU's model and flags

    return machine()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# What each model's prefill is compared with in --table: the same shape (Samba, Llama) or the same layout.
BASELINES = {"Samba-1.3B": "Llama-1.3B", "Phi-4-mini-flash": "Llama-3.8B", "Mamba-2-Hybrid": "NemotronH"}
DECODE_MODES = ("eager", "eager_no_cudnn", "graphs")  # a decode cell: "eager / eager, sdpa without cuDNN / graphs"


def table(paths: list[str]) -> str:
    """The runs as Markdown for benchmarks/results/HISTORY.md, in the paper's Table 4 spirit: per run and model,
    prefill tokens/s at each length (Samba's ratio to the same run's Llama, the Mamba-2-Hybrid's to NemotronH),
    decode tokens/s per context x batch (eager / eager with sdpa kept off cuDNN, for transformers' models /
    graphs), the training step's tokens/s; each run's label, device and date on its heading."""

    def cell(entry, key="tokens_per_s"):
        if not isinstance(entry, dict):
            return "-"
        if key in entry:
            return f"{entry[key]:,.0f}"
        return "OOM" if entry.get("error") == "out of memory" else ("skipped" if "skipped" in entry else "failed")

    lines = []
    for path in paths:
        run = json.load(open(path))
        lines += [f"#### {run['label']}: {run['device']}, {run['dtype']}, {run['date']} (`{run['command']}`)", ""]
        lengths = sorted({int(n) for row in run["models"].values() for n in row["prefill"]})
        contexts = sorted(
            {k for row in run["models"].values() for k in row["decode"]}, key=lambda k: tuple(map(int, k.split("x")))
        )

        def tokens(n):
            return f"{int(n) // 1024}K" if int(n) >= 1024 else str(n)

        trained = sorted({int(n) for row in run["models"].values() for n in row["train"]})
        heading = (
            [f"prefill {tokens(n)}" for n in lengths]
            + [f"decode {tokens(k.split('x')[0])} b{k.split('x')[1]}" for k in contexts]
            + [f"train {tokens(n)}" for n in trained]
        )
        lines += ["| model | " + " | ".join(heading) + " |", "|---" * (1 + len(heading)) + "|"]
        for name, row in run["models"].items():
            baseline = run["models"].get(BASELINES.get(name), {}).get("prefill", {})
            prefill = []
            for n in lengths:
                entry, base = row["prefill"].get(str(n)), baseline.get(str(n)) or {}
                ratio = ""
                if "tokens_per_s" in (entry or {}) and "tokens_per_s" in base:
                    ratio = f" ({entry['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
                prefill.append(cell(entry) + ratio)
            decode = [" / ".join(cell(row["decode"].get(k, {}).get(mode)) for mode in DECODE_MODES) for k in contexts]
            train = [cell(row["train"].get(str(n))) for n in trained]
            lines.append(f"| {name} | " + " | ".join(prefill + decode + train) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(paths: list[str], out: str):
    """Figure 2's two panels: prefill and decode (batch 1, eager and graphs) throughput against length, every model
    of every file, labelled with the file's --label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [json.load(open(p)) for p in paths]
    for run in runs:
        for name, row in run["models"].items():
            points = [(int(k), v["tokens_per_s"]) for k, v in row["prefill"].items() if "tokens_per_s" in v]
            if points:
                left.plot(*zip(*points), marker="o", label=f"{name} ({run['label']})")
            for mode, style in (("eager", "-"), ("graphs", "--")):
                points = [
                    (int(k.split("x")[0]), v[mode]["tokens_per_s"])
                    for k, v in row["decode"].items()
                    if k.endswith("x1") and "tokens_per_s" in v.get(mode, {})
                ]
                if points:
                    right.plot(*zip(*points), style, marker="o", label=f"{name} ({run['label']}, {mode})")
    for axis, title in ((left, "prefill: prompt tokens/s"), (right, "decode, batch 1: tokens/s")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tokens" if axis is left else "context (tokens)")
        axis.set_title(title)
        axis.legend(fontsize=6)
    fig.suptitle(f"{runs[0]['device']}, {runs[0]['dtype']}, {runs[0]['date']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"a subset of {','.join(MODELS)}")
    parser.add_argument("--prefill", default="2048,4096,8192,16384,32768,65536,131072")
    parser.add_argument("--decode", default="1024,16384,65536")
    parser.add_argument(
        "--batch",
        default="16",
        help="decode batch sizes besides 1, comma-separated (larger ones are skipped past an out of memory; graphs "
        "take the first)",
    )
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--train", default="4096", help="training-step lengths (none: an empty string)")
    parser.add_argument(
        "--verify-tokens",
        type=int,
        default=9,
        help="checking drafts: a recorded forward of this many tokens (8 drafts and the current one) against a "
        "one-token step, at each --decode context; 0: not measured",
    )
    parser.add_argument("--repeat", type=int, default=2, help="prefill: best of this many")
    parser.add_argument(
        "--cap",
        type=float,
        default=10.0,
        help="seconds: a prefill predicted to take longer (scaled from the last length) is skipped",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=float("inf"),
        help="seconds for the whole run: measurements after it are skipped (the JSON still written)",
    )
    parser.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also decode through generate with a static cache (compiled, CUDA graphs)",
    )
    parser.add_argument(
        "--micro",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first, the micro-benchmarks: one layer's sliding-window attention, Mamba conv and scans, scan configs",
    )
    parser.add_argument(
        "--graphs-max-context",
        type=int,
        default=1024,
        help="contexts up to this decode with graphs too (each context and batch compiles anew)",
    )
    parser.add_argument(
        "--kernels",
        choices=("all", "triton", "none"),
        default="all",
        help="samba-hf's kernels in this run, through the kernel switch: all that are installed "
        '(kernel_implementation="auto"); samba-hf\'s Triton kernels alone, what pip install gives ("samba"); none '
        '("pytorch"). NemotronH takes mamba-ssm where it imports, except with triton or none',
    )
    parser.add_argument("--label", default=None, help="names this run in the plot (default: from the kernels found)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models on the CPU: checks this script, measures nothing"
    )
    parser.add_argument(
        "--plot", nargs="+", default=None, help="JSON files of earlier runs: draw them, measure nothing"
    )
    parser.add_argument("--plot-out", default="out/gpu/figure2.png")
    parser.add_argument(
        "--table",
        nargs="+",
        default=None,
        help="JSON files of earlier runs: print them as Markdown tables (tokens/s), measure nothing",
    )
    args = parser.parse_args(argv)
    for option in ("table", "plot"):
        missing = [p for p in getattr(args, option) or () if not os.path.isfile(p)]
        if missing:
            parser.error(f"--{option}: no such file: {', '.join(missing)}")
    if args.table:
        print(table(args.table))
        return 0
    if args.plot:
        return plot(args.plot, args.plot_out)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models takes names from {','.join(MODELS)}, got {', '.join(sorted(unknown))}")
    for option in ("prefill", "decode", "train", "batch"):
        try:
            values = ints(getattr(args, option))
        except ValueError:
            what = "sizes" if option == "batch" else "token counts"
            parser.error(f"--{option} takes comma-separated {what}, got {getattr(args, option)!r}")
        if any(v < 1 for v in values):
            parser.error(f"--{option} takes positive numbers, got {getattr(args, option)!r}")
    if args.verify_tokens < 0 or args.verify_tokens == 1:
        parser.error("--verify-tokens takes 0 (not measured) or 2 or more tokens")
    if not ints(args.batch) or args.steps < 2 or args.repeat < 1 or args.cap <= 0 or args.time_limit <= 0:
        parser.error(
            "--batch takes one or more sizes, --repeat 1 or more, --steps 2 or more, --cap and --time-limit a "
            "positive number of seconds"
        )
    if args.out and os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a folder: give the JSON file's path")
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py: no CUDA GPU on this machine (torch {torch.__version__}); nothing measured. Run it "
            "on a GPU machine, or pass --smoke to check the script on tiny models here.",
            file=sys.stderr,
        )
        return 1
    else:
        device = torch.device("cuda")
    global KERNELS
    KERNELS = args.kernels
    ssm_samba.load_kernels()  # every kernel installed, found before NemotronH's packages are hidden
    if args.kernels != "all":
        hide_kernel_packages()
    if args.label is None:
        found = kernels_present()
        shown = ("selective_scan_fn", "causal_conv1d_fn", "selective_scan_triton", "flash_attn")
        args.label = "+".join(k for k in shown if found[k]) or "torch"
    measure(args, device)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
