"""`tokenizer_from_sentencepiece` against SentencePiece itself, on small models trained here (no downloads).

Each model is trained in memory on a small multilingual corpus (prose, indented code, digits, CJK, emoji, accents);
the converted tokenizer must give `sp.encode_as_ids` for every text and `sp.decode_ids` for every id sequence.
"""

import io
import json
import random
import subprocess
import sys
import unicodedata

import pytest

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")
from sentencepiece import sentencepiece_model_pb2  # noqa: E402

from samba_hf.conversion.checkpoint import ConversionError  # noqa: E402
from samba_hf.conversion.sentencepiece_tokenizer import tokenizer_from_sentencepiece  # noqa: E402

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces, and models read the pieces.",
    "It was 3.14159 at 12:45, and 12345 people were there!",
    "Don't panic; it's only a test (of the tokenizer).",
    "Café au lait, naïve résumé, façade, coöperate.",
    "Straße, Mädchen, Größe und Übermut.",
    "¿Dónde está el niño?",
    "Tiếng Việt có dấu: người, được, những.",
    "日本語のテキストです。東京は日本の首都です。",
    "カタカナとひらがなと漢字を混ぜた文章。",
    "我们喜欢自然语言处理。中文分词很有意思。",
    "今天天气很好，我们去公园吧！",
    "I love pizza 🍕 and parties 🎉, ok 👍 😀",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024-06-01 +49 (0) 30 1234567",
]
CODE = [
    "def add(x, y):\n    return x + y\n",
    "class Foo(object):\n    def __init__(self):\n        self.value = 42\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i)\n",
    "    # indented comment\n        deeper = [1, 2, 3]\n",
    "if (a && b) {\n  return a->next;\n}\n",
    "x = {'key': \"value\", 'n': 3.5e-3}\n",
]


def corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        lines.append(" ".join(rng.sample(PROSE, 2)))
        lines.append(rng.choice(CODE))
    return lines


CONFIGS = {
    # Closest to a 2023 NVIDIA multilingual tokenizer, with the default normalizer (nmt_nfkc, dummy prefix, extra
    # whitespace removed).
    "bpe_nmt_nfkc": dict(model_type="bpe", byte_fallback=True, split_digits=True),
    # The same without normalization, keeping whitespace (code-friendly), with whitespace-only pieces.
    "bpe_identity": dict(
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
    ),
    "unigram_nmt_nfkc": dict(model_type="unigram", byte_fallback=True),
    "unigram_identity": dict(
        model_type="unigram", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False
    ),
    "char_nmt_nfkc": dict(model_type="char", byte_fallback=True),
    # Plain NFKC (it deletes no character), keeping whitespace.
    "bpe_nfkc": dict(
        model_type="bpe", byte_fallback=True, normalization_rule_name="nfkc", remove_extra_whitespaces=False
    ),
    # The dummy "▁" at the end of the text, and pieces ending with it.
    "bpe_suffix": dict(
        model_type="bpe", byte_fallback=True, treat_whitespace_as_suffix=True, normalization_rule_name="identity"
    ),
    # No byte fallback (unknown characters are <unk>), no dummy prefix, user-defined and control symbols, a pad.
    "bpe_symbols": dict(
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        user_defined_symbols=["<sep>", "[MASK]"],
        control_symbols=["<ctl>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
    ),
}


def train(**options) -> bytes:
    model = io.BytesIO()
    options = dict(vocab_size=800, hard_vocab_limit=False, minloglevel=2, num_threads=2) | options
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=model, **options)
    return model.getvalue()


@pytest.fixture(scope="module", params=list(CONFIGS))
def converted(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.model"
    path.write_bytes(train(**CONFIGS[request.param]))
    return request.param, path, spm.SentencePieceProcessor(model_file=str(path)), tokenizer_from_sentencepiece(path)


NEVER_SEEN = "☃ ∮ 𝕏 ⨌ Ω 🦕"  # no character of these is in the corpus: byte pieces (or <unk>)
TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\t\t",
    " \n ",
    "  \n\n  ",
    "a",
    " a",
    "a ",
    "  leading",
    "trailing   ",
    "multiple   inner    spaces",
    " \t mixed \n whitespace \r\n ",
    "line one\nline two\n\nline four",
    "\r\n",
    "12345 3.14159",
    "x=1234567890;",
    "0.5 + 0.25 = 0.75",
    *PROSE,
    *CODE,
    "    four spaces",
    "\tone tab",
    "日本語",
    "中文",
    "😀",
    "👨‍👩‍👧",
    "❤️",
    "e\u0301",
    "cafe\u0301 nai\u0308ve",
    unicodedata.normalize("NFD", PROSE[7]),
    "ＡＢＣ１２３ (full width)",
    "ｶﾀｶﾅ ｶﾞｷﾞ ﾊﾟ",
    "Ａ\u0301",
    "ﬁ ™ ½ ① ㈱",
    "\u00a0nbsp\u3000ideographic space",
    "ㄱㅏ ㅋㅋ",
    "\u1100\u1161\u11a8",
    NEVER_SEEN,
    "mixed 日本 and English 123 ☃!",
    "\x01control\x7f",
    "\u200bzero width",
    "▁",
    "a▁b",
    "▁lead",
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<0x41>",
    "a<s>b</s>c",
    "<sep>",
    "x<sep>y [MASK] z",
    "<ctl>",
    "\ufffd",
    "İstanbul ß Ω",
    "…«»“”",
    "$ cat /etc/hosts | grep -v '#'",
]


def random_texts(count: int, seed: int) -> list[str]:
    """Texts glued from pieces that can meet anywhere (combining marks only right after their letter)."""
    rng = random.Random(seed)
    units = [
        "the",
        "fox",
        "Tokenizer",
        "x",
        "=",
        "(",
        ")",
        ":",
        ".",
        ",",
        "'",
        '"',
        "0",
        "7",
        "42",
        "3.5",
        " ",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "    ",
        "日",
        "本",
        "語",
        "中",
        "文",
        "の",
        "カ",
        "ｶ",
        "ﾞ",
        "😀",
        "🍕",
        "e\u0301",
        "ñ",
        "ü",
        "ệ",
        "Ａ",
        "１",
        "ﬁ",
        "\u3000",
        "\u00a0",
        "☃",
        "𝕏",
        "▁",
        "<s>",
        "<sep>",
        "\r\n",
        "ㄱ",
        "ㅏ",
    ]
    return ["".join(rng.choice(units) for _ in range(rng.randint(0, 12))) for _ in range(count)]


def test_encode_like_sentencepiece(converted):
    name, _, sp, tok = converted
    texts = TEXTS + random_texts(400, seed=len(name)) + corpus()[:100]
    for text in texts:
        expected = sp.encode_as_ids(text)
        assert tok(text, add_special_tokens=False).input_ids == expected, (name, text, sp.id_to_piece(expected))
        assert tok(text).input_ids == expected, (name, text)  # no BOS/EOS by default
        assert tok.encode(text) == expected
    batch = tok(texts).input_ids
    assert batch == [sp.encode_as_ids(text) for text in texts]


def test_unseen_characters_are_bytes_or_unk(converted):
    name, _, sp, tok = converted
    ids = tok(NEVER_SEEN).input_ids
    assert ids == sp.encode_as_ids(NEVER_SEEN)
    tokens = tok.convert_ids_to_tokens(ids)
    if CONFIGS[name].get("byte_fallback"):
        assert {"<0xE2>", "<0x98>", "<0x83>"} <= set(tokens)  # ☃ = E2 98 83
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == sp.decode_ids(ids) == sp.decode_ids(sp.encode_as_ids(NEVER_SEEN))
    else:
        assert tok.unk_token_id in ids and "<0xE2>" not in tokens
        assert tok.decode(ids) == sp.decode_ids(ids)  # each run of unknown characters is one " ⁇ "


def test_decode_like_sentencepiece(converted):
    name, _, sp, tok = converted
    for text in TEXTS + random_texts(200, seed=100 + len(name)):
        ids = sp.encode_as_ids(text)
        assert tok.decode(ids) == sp.decode_ids(ids), (name, text, sp.id_to_piece(ids))
        # Control pieces are invisible in decode_ids; they are here too, with special tokens kept or skipped
        # (skipping also drops <unk>, a special token, which decode_ids writes as " ⁇ ").
        framed = [sp.bos_id(), *ids, sp.eos_id()]
        assert tok.decode(framed) == sp.decode_ids(framed)
        known = [i for i in ids if not sp.is_unknown(i)]
        assert tok.decode(framed, skip_special_tokens=True) == sp.decode_ids(known)


def byte_run_mixes_characters_and_errors(sp, ids) -> bool:
    """A run of byte pieces holding a complete multi-byte character and an invalid byte: SentencePiece keeps the
    character, tokenizers' ByteFallback writes U+FFFD for every byte of the run (the documented difference)."""
    run = []
    for piece in sp.id_to_piece(list(ids)) + [""]:
        if piece and sp.is_byte(sp.piece_to_id(piece)):
            run.append(int(piece[3:5], 16))
            continue
        text = bytes(run).decode("utf-8", "replace")
        if "\ufffd" in text and any(ord(c) > 127 and c != "\ufffd" for c in text):
            return True
        run = []
    return False


def test_decode_arbitrary_ids(converted):
    """Random id sequences: normal, control, unknown and user-defined pieces, and byte pieces alone or spelling
    characters, truncated characters and bytes that are never UTF-8."""
    name, _, sp, tok = converted
    rng = random.Random(7)
    size = sp.get_piece_size()
    specials = [i for i in range(size) if sp.is_control(i) or sp.is_unknown(i)]
    byte_ids = {int(sp.id_to_piece(i)[3:5], 16): i for i in range(size) if sp.is_byte(i)}
    compared = 0
    for _ in range(600):
        ids = []
        for _ in range(rng.randint(0, 10)):
            kind = rng.random()
            if kind < 0.45 or not byte_ids:
                ids.append(rng.randrange(size))
            elif kind < 0.6:
                ids.append(rng.choice(specials))
            elif kind < 0.8:  # a whole character, or its start (not U+2581: the other documented difference)
                encoded = rng.choice("é日😀 ☃\n").encode()
                ids += [byte_ids[b] for b in encoded[: rng.choice([len(encoded), 1])]]
            else:  # a lone byte: ASCII, continuation, lead or never valid
                ids.append(byte_ids[rng.choice([0x41, 0x20, 0x0A, 0x80, 0xBF, 0xC3, 0xE6, 0xF0, 0xC0, 0xFF])])
        if byte_run_mixes_characters_and_errors(sp, ids):
            continue
        compared += 1
        assert tok.decode(ids) == sp.decode_ids(ids), (name, ids, sp.id_to_piece(ids))
    assert compared > 400


def test_special_tokens_and_vocabulary(converted):
    name, _, sp, tok = converted
    assert len(tok) == sp.get_piece_size()
    for attribute, index in [("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id())]:
        if index < 0:
            assert getattr(tok, f"{attribute}_token") is None
        else:
            assert getattr(tok, f"{attribute}_token") == sp.id_to_piece(index)
            assert getattr(tok, f"{attribute}_token_id") == index
    assert tok.convert_ids_to_tokens(list(range(len(tok)))) == [sp.id_to_piece(i) for i in range(len(tok))]
    # Special tokens written in a text are characters, as for SentencePiece.
    assert tok("<s> </s> <unk>").input_ids == sp.encode_as_ids("<s> </s> <unk>")
    assert sp.bos_id() not in tok("<s>").input_ids


def test_save_and_load_without_samba_hf(tmp_path):
    """save_pretrained, then AutoTokenizer in a fresh process that never imports samba_hf: the same ids and texts."""
    folders, expected = [], []
    texts = TEXTS + random_texts(50, seed=3)
    for name in ["bpe_nmt_nfkc", "bpe_symbols"]:
        path = tmp_path / f"{name}.model"
        path.write_bytes(train(**CONFIGS[name]))
        sp = spm.SentencePieceProcessor(model_file=str(path))
        tokenizer_from_sentencepiece(path).save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
        ids = [sp.encode_as_ids(text) for text in texts]
        expected.append([ids, [sp.decode_ids(i) for i in ids], [sp.bos_id(), sp.eos_id(), sp.pad_id()]])
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "folders, texts = json.load(sys.stdin)\n"
        "out = []\n"
        "for folder in folders:\n"
        "    tok = AutoTokenizer.from_pretrained(folder)\n"
        "    ids = [tok(text).input_ids for text in texts]\n"
        "    out.append([ids, [tok.decode(i) for i in ids],\n"
        "                [tok.bos_token_id, tok.eos_token_id, "
        "-1 if tok.pad_token_id is None else tok.pad_token_id]])\n"
        "assert not any(name.startswith('samba_hf') for name in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([folders, texts]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_user_defined_symbols_with_dummy_prefix(tmp_path):
    """Symbols are matched in the normalized text, after the dummy prefix and with the whitespace handling around them,
    as SentencePiece does. (A text that is exactly one symbol is the documented exception.)"""
    path = tmp_path / "symbols.model"
    path.write_bytes(train(model_type="bpe", byte_fallback=True, user_defined_symbols=["<sep>", "[MASK]", "##"]))
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tok = tokenizer_from_sentencepiece(path)
    texts = [
        "<sep>a",
        "a<sep>",
        "a <sep> b",
        "  <sep>  x  ",
        "<sep><sep>",
        "x<sep>[MASK]y",
        "## heading ##",
        "a<se p>b",
        "<sep\n>",
        "[MASK] is [MASK].",
        "<<sep>>",
        "日本<sep>語",
        "\t<sep>\n",
    ]
    for text in texts + [text.replace("x", "<sep>") for text in random_texts(100, seed=5)]:
        if text.strip() in ("<sep>", "[MASK]", "##"):
            continue
        ids = sp.encode_as_ids(text)
        assert tok(text).input_ids == ids, (text, sp.id_to_piece(ids))
        assert tok.decode(ids) == sp.decode_ids(ids)
    symbols = ["<sep>", "[MASK]", "##"]
    assert tok.convert_tokens_to_ids(symbols) == [sp.piece_to_id(symbol) for symbol in symbols]
    with pytest.raises(ConversionError, match="user_defined_symbols"):
        tokenizer_from_sentencepiece(path, strict=True)


def test_strict(tmp_path):
    """strict=True accepts what is exact for every text and refuses what is exact for all but some."""
    exact = tmp_path / "exact.model"
    exact.write_bytes(train(**CONFIGS["bpe_identity"]))
    tok = tokenizer_from_sentencepiece(exact, strict=True)
    assert tok("def f():\n\treturn 1").input_ids == spm.SentencePieceProcessor(model_file=str(exact)).encode_as_ids(
        "def f():\n\treturn 1"
    )
    for name, setting in [("bpe_nmt_nfkc", "precompiled_charsmap"), ("unigram_identity", "model_type=unigram")]:
        path = tmp_path / f"{name}.model"
        path.write_bytes(train(**CONFIGS[name]))
        with pytest.raises(ConversionError, match=setting):
            tokenizer_from_sentencepiece(path, strict=True)


def edited(blob: bytes, edit) -> bytes:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(blob)
    edit(proto)
    return proto.SerializeToString()


def test_unsupported_settings_are_refused(tmp_path):
    base = train(**CONFIGS["bpe_identity"])
    word_model = train(model_type="word", vocab_size=300)  # its normalizer is the default nmt_nfkc map
    charsmap = sentencepiece_model_pb2.ModelProto.FromString(word_model).normalizer_spec.precompiled_charsmap

    def unused(proto):
        proto.pieces[-1].type = sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED

    def denormalizer(proto):
        proto.denormalizer_spec.name = "nmt_nfkc"
        proto.denormalizer_spec.precompiled_charsmap = charsmap

    cases = {
        "model_type=word": word_model,
        "UNUSED": edited(base, unused),
        "denormalizer_spec": edited(base, denormalizer),
        "user_defined_symbols": train(model_type="unigram", byte_fallback=True, user_defined_symbols=["<sep>"]),
    }
    for setting, blob in cases.items():
        path = tmp_path / "refused.model"
        path.write_bytes(blob)
        with pytest.raises(ConversionError, match=rf"{setting}.*cannot be converted exactly"):
            tokenizer_from_sentencepiece(path)
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    with pytest.raises(ConversionError, match="SentencePiece model"):
        tokenizer_from_sentencepiece(tmp_path / "garbage.model")


def test_a_truncated_model_is_not_a_sentencepiece_model(tmp_path):
    """A file cut anywhere, even between two pieces (where protobuf parses what is left), is refused as such."""
    blob = train(**CONFIGS["bpe_identity"])
    between_pieces = edited(
        blob, lambda proto: (proto.ClearField("trainer_spec"), proto.ClearField("normalizer_spec"))
    )
    assert blob.startswith(between_pieces[:-8])
    for cut in (b"", blob[:7], blob[: len(blob) // 3], between_pieces, blob[:-3]):
        (tmp_path / "cut.model").write_bytes(cut)
        with pytest.raises(ConversionError, match=r"cut.model is not a SentencePiece model .*: the file is truncated"):
            tokenizer_from_sentencepiece(tmp_path / "cut.model")
