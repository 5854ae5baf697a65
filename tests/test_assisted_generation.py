"""Assisted generation (prompt lookup, an assistant model) on the hybrid cache: greedy tokens equal plain greedy
decoding's, token for token, on every layout, with drafts accepted whole, in part, not at all, and empty; past the
window; across inference chunks; with the compiled and the PyTorch scan. The cache records only while transformers
verifies drafts, at most one state per drafted token and two more, and lets go of them at every `crop`."""

import pytest
import torch
from conftest import returned_cache, tiny_model
from test_mamba2 import tiny_mamba2
from test_sambay import tiny_model as tiny_sambay
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import candidate_generator

from samba_hf import cache_samba, ssm_samba

NEW = 60  # tokens generated: seven windows of 8


def layout(name: str):
    if name == "samba":
        return tiny_model(seed=11)
    if name in (
        "megatron",
        "samba2",
    ):  # the Mamba-2-Hybrid layout (Mamba-2, attention, MLP blocks); Samba with Mamba-2
        return tiny_mamba2(name, seed=3)
    return tiny_sambay(seed=5)[0]


def repetitive_prompt(vocab: int, seed: int = 0) -> torch.Tensor:
    """A phrase said three times with other words between: some n-grams recur, some never do."""
    g = torch.Generator().manual_seed(seed)
    phrase, other = torch.randint(3, vocab, (1, 12), generator=g), torch.randint(3, vocab, (1, 5), generator=g)
    return torch.cat([phrase, other, phrase, other.flip(1), phrase[:, :7]], dim=1)


@pytest.fixture
def spy(monkeypatch):
    """What each round drafted (candidate tokens), and how many states each Mamba layer held at each `crop`."""
    seen = {"drafts": [], "held": [], "crops": [], "layers": []}
    for cls in (candidate_generator.PromptLookupCandidateGenerator, candidate_generator.AssistedCandidateGenerator):
        original = cls.get_candidates

        def get_candidates(self, input_ids, *args, _original=original, **kwargs):
            candidates, logits = _original(self, input_ids, *args, **kwargs)
            seen["drafts"].append(candidates.shape[1] - input_ids.shape[1])
            return candidates, logits

        monkeypatch.setattr(cls, "get_candidates", get_candidates)
    crop = cache_samba.SambaMambaLayer.crop

    def counted_crop(self, tokens_to_remove):
        seen["held"].append(len(self.recorded))
        seen["crops"].append(-tokens_to_remove)
        seen["layers"].append(self)
        crop(self, tokens_to_remove)
        assert self.recorded == []

    monkeypatch.setattr(cache_samba.SambaMambaLayer, "crop", counted_crop)
    return seen


def greedy(model, ids, **mode):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **mode)


@pytest.mark.parametrize("name", ["samba", "megatron", "samba2", "sambay"])
def test_prompt_lookup_gives_the_greedy_tokens(name, spy):
    model = layout(name)
    ids = repetitive_prompt(model.config.vocab_size)
    expected = greedy(model, ids)
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=5), expected)
    drafts = spy["drafts"]
    assert 0 in drafts and max(drafts) == 5  # empty drafts between full ones (vLLM's wrong case)
    removed = [n for n in spy["crops"] if n]
    assert spy["crops"].count(0) and removed  # drafts accepted whole, and taken back
    # each Mamba layer held at most k + 2 states between crops (the state its first recorded token started from, then
    # one per token), k + 3 in the verification that began with the prompt
    assert max(spy["held"]) <= max(drafts) + 3


@pytest.mark.parametrize("name", ["samba", "megatron", "sambay"])
def test_an_assistant_gives_the_greedy_tokens(name, spy):
    """A smaller model of the same family (another seed: drafts partly right) and the model itself (every draft
    accepted)."""
    model = layout(name)
    ids = repetitive_prompt(model.config.vocab_size, seed=1)
    expected = greedy(model, ids)
    assistant = tiny_model(seed=12, vocab_size=model.config.vocab_size) if name != "sambay" else tiny_sambay(seed=6)[0]
    assert torch.equal(greedy(model, ids, assistant_model=assistant), expected)
    assert torch.equal(greedy(model, ids, assistant_model=layout(name)), expected)
    assert spy["crops"].count(0) and any(spy["crops"])


def test_drafts_that_are_all_wrong_change_nothing(spy):
    """An assistant whose every draft is refused (it only ever says token 3, which the model never says here)."""
    model = tiny_model(seed=11)
    ids = repetitive_prompt(97)
    expected = greedy(model, ids)
    assert 3 not in expected[0, ids.shape[1] :]
    assistant = tiny_model(seed=12)
    with torch.no_grad():
        assistant.lm_head.weight.zero_()
        assistant.lm_head.weight[3] = 1.0
        assistant.model.norm.weight.fill_(1.0)
    out = greedy(model, ids, assistant_model=assistant, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    mine = {id(layer) for layer in returned_cache(out).layers}
    main_crops = [n for n, layer in zip(spy["crops"], spy["layers"]) if id(layer) in mine]
    assert main_crops and all(n > 0 for n in main_crops[: -len(mine)])  # (the last round may stop at max_length)


def test_a_transformers_model_assists_samba():
    model = tiny_model(seed=11)
    ids = repetitive_prompt(97, seed=2)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    assert torch.equal(greedy(model, ids, assistant_model=llama), greedy(model, ids))


def test_across_inference_chunks_with_the_pytorch_scan(monkeypatch, spy):
    """The verification that begins with the prompt goes through the cache in chunks (then the recorded tail), and
    the PyTorch scan steps the drafts as the compiled one does."""
    model = tiny_model(seed=11)
    ids = torch.cat([repetitive_prompt(97, seed=3)] * 2, dim=1)  # 72 tokens
    expected = greedy(model, ids)
    model.config.inference_chunk_size = 16
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=10), expected)
    monkeypatch.setattr(ssm_samba, "cpu_scan_available", lambda: False)
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=10), expected)
    assert max(spy["drafts"]) == 10 > model.config.sliding_window  # drafts longer than the window


def test_plain_decoding_records_nothing(monkeypatch):
    model = tiny_model(seed=11)
    calls = []
    monkeypatch.setattr(cache_samba.SambaMambaLayer, "record_states", lambda self, states: calls.append(states))
    with torch.no_grad():
        out = model.generate(repetitive_prompt(97), max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert calls == []
    mamba = [layer for layer in returned_cache(out).layers if isinstance(layer, cache_samba.SambaMambaLayer)]
    assert mamba and not any(layer.record_past for layer in mamba)


def test_a_crop_past_what_was_recorded_says_so():
    model = tiny_model(seed=11)
    cache = cache_samba.DynamicCache(config=model.config)
    cache.activate_past_recording()
    ids = repetitive_prompt(97)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True, logits_to_keep=3)  # records the last 4 tokens' states
    cache.crop(-3)
    with torch.no_grad():
        model(ids[:, :2], cache=cache, use_cache=True, logits_to_keep=2)
    with pytest.raises(RuntimeError, match=r"back 3 tokens, but it recorded the states of only the last 2"):
        cache.crop(-3)


def test_batches_are_refused_in_one_line():
    model = tiny_model(seed=11)
    ids = repetitive_prompt(97).repeat(2, 1)
    with pytest.raises(ValueError, match="assisted generate is only supported for batch_size = 1"):
        greedy(model, ids, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("name", ["samba", "megatron", "samba2", "sambay"])
@pytest.mark.parametrize("back", [0, 1, 4, 6])
def test_crop_takes_every_layer_back_to_the_token(name, back):
    """A recording cache that verified a 6-token draft (after a prompt verified with a first draft), taken back by
    `back` tokens, continues as a cache that never saw them: the next logits equal those of a forward over the kept
    tokens alone. The window (8, 4 for SambaY) is passed within the drafts."""
    model = layout(name)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, 40), generator=torch.Generator().manual_seed(back))
    after = ids[:, 29:31]
    with torch.no_grad():
        cache = cache_samba.DynamicCache(config=model.config)
        cache.activate_past_recording()
        model(ids[:, :23], cache=cache, use_cache=True, logits_to_keep=4)  # the prompt and a 3-token draft
        cache.crop(-1)  # its last token refused
        model(
            ids[:, 22:29], cache=cache, use_cache=True, logits_to_keep=7
        )  # the model's next token and a 6-token draft
        cache.crop(-back)
        got = model(after, cache=cache, use_cache=True).logits
        reference = model(torch.cat([ids[:, : 29 - back], after], 1)).logits[:, -2:]
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["samba", "sambay"])
def test_crop_takes_back_every_token_of_one_recorded_forward(name):
    """A forward of 5 tokens over a recording cache, all of them taken back (`crop(-5)`), as Llama's cache allows:
    the cache continues as the one before that forward."""
    model = layout(name)
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = cache_samba.DynamicCache(config=model.config)
        cache.activate_past_recording()
        model(ids[:, :12], cache=cache, use_cache=True)
        cache.crop(0)
        model(ids[:, 12:17], cache=cache, use_cache=True)  # every token's logits: every token recorded
        cache.crop(-5)
        got = model(ids[:, 17:20], cache=cache, use_cache=True).logits
        reference = model(torch.cat([ids[:, :12], ids[:, 17:20]], 1)).logits[:, -3:]
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


def test_recording_turned_off_by_hand_between_forwards_continues_as_plain_decoding():
    """`record_past` set back to False on every layer after a recording forward, with no `crop`: the next forward
    lets go of what was kept (was a bare tensor-size RuntimeError) and gives a cache's logits that never recorded."""
    model = layout("samba")
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = cache_samba.DynamicCache(config=model.config)
        cache.activate_past_recording()
        model(ids[:, :13], cache=cache, use_cache=True)
        for layer in cache.layers:
            layer.record_past = False
        got = model(ids[:, 13:], cache=cache, use_cache=True).logits
        reference = model(ids).logits[:, 13:]
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["samba", "sambay"])
def test_the_cache_assisted_generation_hands_back_records_nothing(name):
    """transformers leaves the cache of assisted decoding recording; samba-hf's hands it back stopped: continuing it
    with plain generate holds what continuing plain generate's cache holds, with the same tokens."""
    from conftest import cache_kwarg, held_bytes

    model = layout(name)
    ids = repetitive_prompt(model.config.vocab_size)
    caches = {}
    for mode, extra in (("plain", {}), ("assisted", dict(prompt_lookup_num_tokens=4))):
        out = greedy(model, ids, return_dict_in_generate=True, **extra)
        cache = returned_cache(out)
        assert not any(getattr(layer, "record_past", False) for layer in cache.layers), mode
        with torch.no_grad():
            more = model.generate(
                out.sequences, max_new_tokens=40, do_sample=False, eos_token_id=None, **cache_kwarg(cache)
            )
        caches[mode] = (more, held_bytes(cache), [len(getattr(layer, "recorded", [])) for layer in cache.layers])
    assert torch.equal(caches["assisted"][0], caches["plain"][0])
    assert caches["assisted"][1:] == caches["plain"][1:]


def test_the_embedded_default_quotes_its_prompt_with_the_greedy_tokens(spy):
    """The trained default model, in float32, rewriting a code file it was shown. (It ships in bfloat16, where plain
    decoding itself parts from a full forward's greedy tokens at near-ties: docs/generation.md.)"""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from samba_hf.cli import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    source = Path(cache_samba.__file__).read_text()[:1200]
    ids = tokenizer(source + "\n\n# The same file again:\n" + source[:300], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=100, do_sample=False)
        got = model.generate(ids, max_new_tokens=100, do_sample=False, prompt_lookup_num_tokens=10)
    assert torch.equal(got, expected)
    assert sum(n == 0 for n in spy["crops"]) > 0


def test_a_static_cache_is_refused_in_one_line():
    model = tiny_model(seed=11)
    with pytest.raises(
        ValueError, match=r"^Assisted generation .* static cache cannot do: leave out cache_implementation"
    ):
        greedy(model, repetitive_prompt(97), prompt_lookup_num_tokens=3, cache_implementation="static")


def test_speculative_sampling_samples_the_models_distribution():
    """Sampling with an assistant (transformers' speculative sampling, which accepts a draft token with probability
    min(1, p / q) and resamples the rest) draws the tokens plain sampling draws: over 250 independent runs each, the
    distributions of each of the first 4 new tokens lie within 0.3 in total variation (run so, a cache that put back
    the wrong state after a refused draft gave about 0.5 from the third token on; the right one 0.02-0.14). SambaY,
    whose tokens depend on its states most among the tiny layouts; its logits sharpened so that a few tokens matter."""
    from collections import Counter

    model, assistant = tiny_sambay(seed=5)[0], tiny_sambay(seed=6)[0]
    with torch.no_grad():
        model.model.final_layernorm.weight.mul_(4)
    prompt = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    runs, samples = 250, {"plain": [], "assisted": []}
    with torch.no_grad():
        for i in range(runs):
            for offset, (mode, extra) in enumerate((("plain", {}), ("assisted", dict(assistant_model=assistant)))):
                torch.manual_seed(i + offset * runs)
                out = model.generate(prompt, max_new_tokens=4, do_sample=True, top_k=0, eos_token_id=None, **extra)
                samples[mode].append(out[0, 12:].tolist())
    for position in range(4):
        plain, assisted = (Counter(sample[position] for sample in samples[mode]) for mode in samples)
        distance = sum(abs(plain[t] - assisted[t]) for t in plain.keys() | assisted.keys()) / (2 * runs)
        assert distance < 0.3, (position, distance)


def test_prompt_lookup_pauses_after_refused_drafts():
    """After each round whose drafts are all refused, no draft for 1, 2, 4, ... tokens (at most the limit); an
    accepted token drafts again at once; a round without a match changes nothing."""
    from samba_hf.speculative_samba import PausingPromptLookup

    lookup = candidate_generator.PromptLookupCandidateGenerator(num_output_tokens=3, max_length=1000)
    pausing = PausingPromptLookup(lookup, max_pause=4)
    quoting = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])  # "5 6" occurred: drafts "7 8 9"

    def rounds(n: int, accepted: int, ids=quoting) -> str:
        seen = ""
        for _ in range(n):
            candidates, _ = pausing.get_candidates(ids)
            drafted = candidates.shape[1] - ids.shape[1]
            seen += "d" if drafted else "."
            pausing.update_candidate_strategy(ids, None, accepted if drafted else 0)
        return seen

    assert rounds(16, accepted=0) == "d.d..d....d....d"  # pauses of 1, 2, 4, then the limit
    assert rounds(4, accepted=0) == "...."  # the pause the last refused round began
    assert rounds(4, accepted=1) == "dddd"  # an accepted token ends the pause
    assert rounds(3, accepted=0, ids=torch.tensor([[1, 2, 3, 4]])) == "..."  # no match: nothing drafted
    assert rounds(2, accepted=0) == "d."  # and no pause begun by the rounds without a match


@pytest.mark.parametrize("name", ["samba", "sambay"])
def test_pausing_prompt_lookup_gives_the_greedy_tokens_and_checks_fewer_drafts(name, spy):
    """A random tiny model quotes its prompt rarely: most drafts are refused. With the pause, fewer drafts are
    checked than with transformers' own prompt lookup (`draft_pause_limit = 0`), and the tokens stay plain greedy's."""
    model = layout(name)
    ids = repetitive_prompt(model.config.vocab_size, seed=4)
    expected = greedy(model, ids)
    model.draft_pause_limit = 0
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=5), expected)
    every_round = sum(1 for d in spy["drafts"] if d)
    spy["drafts"].clear()
    model.draft_pause_limit = 32
    assert torch.equal(greedy(model, ids, prompt_lookup_num_tokens=5), expected)
    assert 0 < sum(1 for d in spy["drafts"] if d) < every_round
