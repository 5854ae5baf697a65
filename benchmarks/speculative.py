"""Speculative decoding on the CPU (#43): prompt lookup against plain greedy decoding, Samba against a same-size Llama.

    python benchmarks/speculative.py --out benchmarks/results/speculative_cpu.json [--new-tokens 200] [--draft 10]
                                     [--repeats 3]

1. The embedded default model on input-grounded prompts made from this repository's files (continuing a code file
   it was shown, quoting a paragraph of documentation it was shown; each within the model's 256-token window), in
   float32 through `generate`: plain greedy against `prompt_lookup_num_tokens=--draft`, with samba-hf's pause after
   refused drafts and without it (`draft_pause_limit = 0`: transformers' own). Tokens/s (the median of
   `--repeats`, alternated), the verification rounds, tokens per round, the acceptance rate (accepted drafted
   tokens / drafted tokens), and whether the tokens are identical. In bfloat16 (where this CPU multiplies it
   natively): how many tokens agree with plain greedy decoding in bfloat16.
2. Samba against a Llama of the same shape (decode_speed.py's: random weights), after a 230-token prompt. A random
   Llama's own drafts would not be accepted as a trained model's are, so both models replay the rounds part 1
   measured in float32 for each task (with the pause: a paused round is a one-token forward): a forward over the
   prompt and the first draft, then per round a forward over the round's tokens and a `crop` to what was accepted,
   as generate runs them; plain: the prompt, then one-token
   steps. Tokens/s of each (the median of `--repeats`), and the speed-ups.
3. The same replay on the ~113M Samba and Llama of run_benchmarks.py (random weights), after a 1K-token prompt.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_serving import run_record  # noqa: E402


def tasks(tokenizer) -> dict[str, torch.Tensor]:
    """Prompts that a continuation can quote: a code file then its first line again; a paragraph then a question
    answered by quoting it."""
    code = (ROOT / "src" / "samba_hf" / "hub_samba.py").read_text().split('"""', 2)[2].strip()
    prose = (ROOT / "docs" / "generation.md").read_text().split("## The cache", 1)[1]
    texts = {
        "code": lambda n: code[:n] + "\n\n\n# The same code, formatted again:\n\n" + code[:60],
        "quote": lambda n: (
            prose[:n] + "\n\nQuestion: what does the cache hold per Mamba layer?\nAnswer, quoting "
            'the text: "' + prose[:40].strip()
        ),
    }
    prompts = {}
    for name, text in texts.items():
        size = 2000
        while len(tokenizer(text(size)).input_ids) > 230:  # the model's window is 256: the source stays in view
            size -= 50
        prompts[name] = tokenizer(text(size), return_tensors="pt").input_ids
    return prompts


def spied_rounds():
    """Patch prompt lookup to note each round's (drafted, accepted), paused rounds included (drafted 0); returns the
    list it fills."""
    from samba_hf.speculative_samba import PausingPromptLookup

    rounds = []
    cls = PausingPromptLookup
    get_candidates, update = cls.get_candidates, cls.update_candidate_strategy

    def noted_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        rounds.append([candidates.shape[1] - input_ids.shape[1], 0])
        return candidates, logits

    def noted_update(self, input_ids, scores, num_matches):
        rounds[-1][1] = int(num_matches)
        return update(self, input_ids, scores, num_matches)

    cls.get_candidates, cls.update_candidate_strategy = noted_candidates, noted_update
    return rounds


def generate_part(args, tokenizer, model_path) -> dict:
    from transformers import AutoModelForCausalLM

    rounds = spied_rounds()
    results = {}
    for name, ids in tasks(tokenizer).items():
        entry = {"prompt_tokens": ids.shape[1]}
        for dtype in ("float32", "bfloat16"):
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
            options = dict(
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None
            )
            times, outputs = {"plain": [], "prompt_lookup_unpaused": [], "prompt_lookup": []}, {}
            with torch.no_grad():
                model.generate(ids[:, :20], max_new_tokens=5, do_sample=False)  # warm-up (the C kernels load)
                for _ in range(args.repeats):
                    for mode in times:  # the paused mode last: `rounds` keeps its trace
                        extra = {} if mode == "plain" else dict(prompt_lookup_num_tokens=args.draft)
                        model.draft_pause_limit = (
                            0 if mode == "prompt_lookup_unpaused" else type(model).draft_pause_limit
                        )
                        rounds.clear()
                        start = time.perf_counter()
                        outputs[mode] = model.generate(ids, **options, **extra)
                        times[mode].append(time.perf_counter() - start)
                model.draft_pause_limit = type(model).draft_pause_limit
            plain, speculative = outputs["plain"][0, ids.shape[1] :], outputs["prompt_lookup"][0, ids.shape[1] :]
            agree = int((plain == speculative).long().cumprod(0).sum())
            drafted, accepted = sum(d for d, _ in rounds), sum(n for _, n in rounds)
            entry[dtype] = {
                "plain_tokens_per_s": args.new_tokens / statistics.median(times["plain"]),
                "prompt_lookup_tokens_per_s": args.new_tokens / statistics.median(times["prompt_lookup"]),
                "unpaused_tokens_per_s": args.new_tokens / statistics.median(times["prompt_lookup_unpaused"]),
                "unpaused_identical": bool(torch.equal(plain, outputs["prompt_lookup_unpaused"][0, ids.shape[1] :])),
                "rounds": len(rounds),
                "checked_rounds": sum(1 for d, _ in rounds if d),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": accepted / max(drafted, 1),
                "tokens_per_round": args.new_tokens / max(len(rounds), 1),
                "identical": bool(torch.equal(plain, speculative)),
                "agreeing_tokens": agree,
                "round_trace": [tuple(r) for r in rounds],
            }
            entry[dtype]["speed_up"] = entry[dtype]["prompt_lookup_tokens_per_s"] / entry[dtype]["plain_tokens_per_s"]
            if dtype == "float32":
                entry["continuation"] = tokenizer.decode(plain[:80])
        results[name] = entry
    return results


def replay(model, prompt: torch.Tensor, trace: list, new_tokens: int) -> tuple[float, float]:
    """(plain, speculative) seconds for `new_tokens` tokens after `prompt`: one-token steps, against the rounds of
    `trace` ([drafted, accepted] each) as generate's assisted loop runs them (forward, then crop)."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    fed = new_tokens + sum(drafted + 1 for drafted, _ in trace)
    tokens = torch.randint(4, vocab, (1, fed), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        for i in range(new_tokens - 1):
            model(tokens[:, i : i + 1], cache=cache, use_cache=True).logits.argmax(-1)
        plain = time.perf_counter() - start

        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        start, made, used, first = time.perf_counter(), 0, 0, True
        for drafted, accepted in trace:
            feed = drafted + 1 if not first else drafted  # the first round's forward holds the prompt instead
            step = tokens[:, used : used + feed] if not first else torch.cat([prompt, tokens[:, :drafted]], 1)
            model(step, cache=cache, use_cache=True, logits_to_keep=drafted + 1).logits.argmax(-1)
            cache.crop(-(drafted - accepted))
            used, made, first = used + feed, made + accepted + 1, False
        speculative = time.perf_counter() - start
    return plain, speculative * new_tokens / made


def replay_part(args, trace, prompt_length: int, models: dict) -> dict:
    results = {}
    for name, model in models.items():
        prompt = torch.randint(
            4, model.config.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(1)
        )
        replay(model, prompt[:, :32], trace[:3], 8)  # warm-up
        runs = [replay(model, prompt, trace, args.new_tokens) for _ in range(args.repeats)]
        plain, speculative = (statistics.median(r[i] for r in runs) for i in (0, 1))
        results[name] = {
            "plain_tokens_per_s": args.new_tokens / plain,
            "prompt_lookup_tokens_per_s": args.new_tokens / speculative,
            "speed_up": plain / speculative,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    return results


def default_size_models(model_path, dtype: torch.dtype = torch.float32):
    """The embedded default in `dtype` (what it keeps in float32 stays so) and a Llama of its shape and size."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    c = AutoConfig.from_pretrained(model_path)
    torch.manual_seed(0)
    llama = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                intermediate_size=797,
                num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                tie_word_embeddings=True,
            )
        )
        .to(dtype)
        .eval()
    )
    samba = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    return {"samba": samba, "llama": llama}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--draft", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="generate,default-size,113m")
    args = parser.parse_args()
    parts = args.parts.split(",")

    from transformers import AutoTokenizer

    import samba_hf  # noqa: F401  (registers the models)
    from samba_hf.cli import default_model_path

    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    result = {**run_record(), "args": vars(args)}
    if "generate" in parts:
        result["generate"] = generate_part(args, tokenizer, model_path)
        print(
            json.dumps(
                {
                    k: {d: {m: v for m, v in e[d].items() if m != "round_trace"} for d in ("float32", "bfloat16")}
                    for k, e in result["generate"].items()
                },
                indent=1,
            )
        )
    traces = {task: entry["float32"]["round_trace"] for task, entry in result.get("generate", {}).items()}
    if not traces:  # without part 1: half of every 10-token draft accepted
        traces = {"half accepted": [[args.draft, args.draft // 2]] * (args.new_tokens // (args.draft // 2 + 1) + 1)}
    if "default-size" in parts:
        models = default_size_models(model_path)
        result["default_size_replay"] = {task: replay_part(args, trace, 230, models) for task, trace in traces.items()}
        print(json.dumps(result["default_size_replay"], indent=1))
    if "113m" in parts:
        from run_benchmarks import build

        models = {name: build(name, "cpu") for name in ("samba", "llama")}
        result["113m_replay"] = {task: replay_part(args, trace, 1024, models) for task, trace in traces.items()}
        print(json.dumps(result["113m_replay"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
