"""Packed sequences (padding-free batches, position_ids restarting per document): nothing crosses a boundary.

The loss and the gradients of a packed batch equal those of the same documents run one by one, for every layer
kind and attention implementation: attention stays within a document and the Mamba conv and scan restart.
"""

import pytest
import torch
from conftest import returned_cache, tiny_model
from transformers import DataCollatorWithFlattening

LAYOUTS = {
    "samba": None,
    "mamba": ["linear_attention"] * 4,
    "full_hybrid": ["linear_attention", "full_attention"] * 2,
}
LENGTHS = (5, 11, 3, 9, 14)  # 14 > the tiny window of 8: sliding layers matter within a document


def documents(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]


def separate_loss(model, docs):
    """Token-weighted mean cross-entropy of each document run alone (what the packed loss must equal)."""
    total, count = 0.0, 0
    for doc in docs:
        logits = model(doc[None]).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.float(), doc[1:], reduction="sum")
        count += len(doc) - 1
    return total / count


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_gradients_equal_separate_documents(layout, attn):
    model = tiny_model(seed=3, layer_types=LAYOUTS[layout]).train()
    model.set_attn_implementation(attn)
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in batch

    packed = model(**batch).loss
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = separate_loss(model, docs)
    alone.backward()

    assert abs(packed.item() - alone.item()) <= 1e-5
    for name, param in model.named_parameters():
        assert (packed_grads[name] - param.grad).abs().max() <= 1e-5, name


def test_packed_logits_equal_separate_documents_with_padding_free_rows():
    model = tiny_model(seed=4)
    docs = documents(seed=1)
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
        without_boundaries = model(ids).logits[0]
    assert (packed - alone).abs().max() <= 1e-5
    assert (without_boundaries - alone).abs().max() > 1e-2  # the boundaries matter in this test


def test_two_rows_sharing_one_row_of_position_ids():
    model = tiny_model(seed=7)
    docs_a, docs_b = documents(seed=4), documents(seed=5)  # same lengths, so one position_ids row fits both
    ids = torch.stack([torch.cat(docs_a), torch.cat(docs_b)])
    position_ids = torch.cat([torch.arange(len(d)) for d in docs_a])[None]  # (1, seq), not expanded
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits
        for row, docs in enumerate((docs_a, docs_b)):
            alone = torch.cat([model(d[None]).logits[0] for d in docs])
            assert (packed[row] - alone).abs().max() <= 1e-5


def test_packed_batch_returns_no_cache_and_cannot_continue_one():
    model = tiny_model(seed=5)
    docs = documents(seed=2)
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        assert returned_cache(model(ids, position_ids=position_ids, use_cache=True)) is None
        cache = returned_cache(model(docs[0][None], use_cache=True))
        with pytest.raises(ValueError, match="cannot continue from a cache"):
            model(ids, position_ids=position_ids, cache=cache)


def test_packed_training_with_gradient_checkpointing():
    model = tiny_model(seed=6).train()
    docs = documents(seed=3)
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    reference = model(**batch).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model(**batch).loss.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6), name
