"""A Hugging Face tokenizer that encodes and decodes like a SentencePiece model file (`*.model`).

Megatron-LM's `GPTSentencePieceTokenizer` (NVIDIA's Mamba-2-Hybrid checkpoints) tokenizes with `sp.encode_as_ids(text)`
(no BOS/EOS) and detokenizes with `sp.decode_ids(ids)`. `tokenizer_from_sentencepiece(model_file)` returns a
`tokenizers`-backed `PreTrainedTokenizerFast` (no custom class: `save_pretrained` writes a tokenizer.json that
`AutoTokenizer` loads without this package) with `tok(text).input_ids == sp.encode_as_ids(text)` and
`tok.decode(ids) == sp.decode_ids(ids)`, built from what the model's proto says:

* normalization (SentencePiece's Normalizer): the character map (precompiled_charsmap: nmt_nfkc, identity, ...; see
  "The character map" below), remove_extra_whitespaces (leading, trailing and repeated U+0020), escape_whitespaces
  (" " -> U+2581), add_dummy_prefix and treat_whitespace_as_suffix (where the dummy U+2581 goes);
* the model: BPE (every pair of pieces whose join is a piece, ranked by the joint piece's score, which is how
  SentencePiece picks the next merge), unigram (Viterbi over the scores) or char; byte_fallback (an unknown character
  becomes its UTF-8 byte pieces <0xNN>), else a run of unknown characters is one <unk>. Training-only settings
  (split_digits, split_by_whitespace, split_by_number, max_sentencepiece_length, ...) shaped the vocabulary and need
  nothing here;
* pieces: control pieces (<s>, </s>, a pad, control_symbols) and <unk> are special tokens at their ids, and never
  matched in text (`split_special_tokens=True`: SentencePiece encodes a "<s>" in the text as characters); bos, eos,
  unk and pad tokens are the model's where its ids are >= 0; user-defined symbols (BPE) are added tokens, matched in
  the normalized text where SentencePiece matches them;
* decoding (SentencePieceProcessor::Decode): U+2581 -> " "; the dummy-prefix space dropped as SentencePiece drops it
  (the first piece's leading U+2581, or with remove_extra_whitespaces one per piece while nothing is written yet);
  control pieces decode to "" whether or not `skip_special_tokens` is set (so skip_special_tokens=False matches
  decode_ids too; True also drops <unk>, which decode_ids writes as unk_surface " \u2047 "); byte pieces to their UTF-8
  text, U+FFFD for a byte that starts no valid character.

A setting that cannot be reproduced raises `ConversionError` naming it: model type word, UNUSED pieces, a
denormalizer, user-defined symbols in a unigram model, holding whitespace, or with treat_whitespace_as_suffix, a
character map this conversion cannot check or reproduce (e.g. the case-folding nmt_nfkc_cf), and pieces that break the
assumptions above (a character inside a piece that is no piece itself, duplicate pieces).

Known differences, none of them in the tests' texts (`strict=True` refuses the settings behind the first four, and a
BPE model whose merged pieces share a score, which trained models never have):
* a character map that composes characters (nmt_nfkc, the default, and nfkc) is reproduced by mapping character by
  character and recomposing with NFC: exact for every rule of the map (all are checked at conversion) and for text in
  NFC or NFD, but combining marks out of canonical order, or a control character nmt_nfkc deletes between a letter and
  its accent, can come out differently;
* unigram: tokenizers adds scores in float64, SentencePiece in float32, so two segmentations that tie exactly (the
  same pieces in another order, e.g. runs of spaces split 13+16 or 16+13) may be resolved differently;
* user-defined symbols with add_dummy_prefix: a text that is exactly one symbol (once remove_extra_whitespaces has
  trimmed it) gets no "\u2581" token before it;
* treat_whitespace_as_suffix with a character map and remove_extra_whitespaces: a text the map deletes entirely
  gets no "\u2581";
* decoding arbitrary ids (never ids from encoding): a run of byte pieces mixing a complete multi-byte character with
  stray bytes decodes to U+FFFD for each of its bytes (SentencePiece keeps the character), and, with add_dummy_prefix
  or remove_extra_whitespaces, byte pieces spelling U+2581 decode to " " (or nothing, first).
"""

import os
import re
import struct
import unicodedata
from functools import lru_cache
from pathlib import Path

from .checkpoint import ConversionError

SPACE = "\u2581"  # SentencePiece's whitespace symbol
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}

# Characters that split grapheme clusters (Control): put between every two characters, one of them makes `tokenizers`'
# Precompiled normalizer map one character at a time (see "The character map" below).
_BREAKERS = [chr(c) for c in [*range(1, 9), 11, 12, *range(14, 32), 127, *range(0x80, 0xA0)]] + [
    "\u200b",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\u00ad",
]


def _escape(text: str) -> str:
    """`text` as a literal inside an Oniguruma regex (what `tokenizers.Regex` compiles)."""
    return "".join(c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):X}}}" for c in text)


def _char_class(chars) -> str:
    """The inside of an Oniguruma character class holding exactly `chars` (as ranges)."""
    codes = sorted(ord(c) for c in chars)
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        parts.append(f"\\x{{{codes[i]:X}}}" + (f"-\\x{{{codes[j]:X}}}" if j > i else ""))
        i = j + 1
    return "".join(parts)


def tokenizer_from_sentencepiece(model_file: str | os.PathLike, *, strict: bool = False):
    """A `PreTrainedTokenizerFast` that encodes and decodes like the SentencePiece model `model_file`.

    It adds no BOS/EOS (`tok(text).input_ids == sp.encode_as_ids(text)`); bos/eos/unk/pad tokens are the model's
    (where its ids are >= 0), at the same ids, and `len(tok) == sp.get_piece_size()`. Raises `ConversionError` for a
    setting that cannot be reproduced; `strict=True` also for those reproduced on all but some texts (the module
    docstring lists them).
    """
    proto, processor = read_sentencepiece(model_file)
    return _Converter(proto, str(model_file), strict, processor).build()


def read_sentencepiece(model_file: str | os.PathLike):
    """(the ModelProto, a SentencePieceProcessor) of a SentencePiece `.model` file; `ConversionError` saying that the
    file is not a SentencePiece model when it is empty, truncated, corrupt or of another format. Every tokenizer
    read from a `.model` file is checked here first."""
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as error:  # sentencepiece_model_pb2 needs protobuf
        raise ConversionError(
            f"reading a SentencePiece model needs `pip install sentencepiece protobuf` ({error})."
        ) from None
    path = Path(model_file)
    try:
        blob = path.read_bytes()
    except OSError as error:
        raise ConversionError(f"cannot read {path} ({error.strerror or error}).") from None
    try:
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(blob)
        # A file cut short between two pieces still parses: its settings, written after the pieces, are then missing.
        if not proto.pieces or not (proto.HasField("trainer_spec") and proto.HasField("normalizer_spec")):
            raise ValueError("no pieces" if not proto.pieces else "its trainer and normalizer settings are missing")
        processor = sentencepiece.SentencePieceProcessor(model_proto=blob)
    except Exception as error:
        why = f"{type(error).__name__}: {str(error).splitlines()[0]}" if str(error) else type(error).__name__
        raise ConversionError(
            f"{path} is not a SentencePiece model ({why}): the file is truncated, corrupt or of "
            "another format. Pass the tokenizer's .model file as trained."
        ) from None
    return proto, processor


class _Converter:
    def __init__(self, proto, name: str, strict: bool, processor):
        self.proto, self.name, self.strict, self.processor = proto, name, strict, processor
        self.normalizer_spec, self.trainer_spec = proto.normalizer_spec, proto.trainer_spec
        self.pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
        self.user_defined = [piece for piece, _, kind in self.pieces if kind == USER_DEFINED]

    def refuse(self, setting: str, why: str):
        raise ConversionError(
            f"{self.name}: {setting} cannot be converted exactly to a Hugging Face tokenizer: {why}."
        )

    # ----------------------------------------------------------------------------------------------------------------
    def build(self):
        from tokenizers import AddedToken, Tokenizer, normalizers
        from transformers import PreTrainedTokenizerFast

        self.check_pieces()
        space = SPACE if self.normalizer_spec.escape_whitespaces else " "
        model = self.unigram() if self.trainer_spec.model_type == UNIGRAM else self.bpe()
        tokenizer = Tokenizer(model)
        steps = self.normalizers(space)
        tokenizer.normalizer = normalizers.Sequence(steps) if steps else None
        tokenizer.pre_tokenizer = self.pre_tokenizer(space)
        tokenizer.decoder = self.decoder()
        tokenizer.post_processor = None
        special = [i for i, (_, _, kind) in enumerate(self.pieces) if kind in (CONTROL, UNKNOWN)]
        tokenizer.add_special_tokens([AddedToken(self.pieces[i][0], special=True, normalized=False) for i in special])
        tokenizer.add_tokens(
            [
                AddedToken(piece, special=False, normalized=True)
                for piece, _, kind in self.pieces
                if kind == USER_DEFINED
            ]
        )
        for i, (piece, _, _) in enumerate(self.pieces):
            if tokenizer.token_to_id(piece) != i:  # an added token got another id than the model's
                self.refuse(f"piece {i} ({piece!r})", "it does not keep its id in the tokenizer")

        def piece_of(index: int):
            return self.pieces[index][0] if 0 <= index < len(self.pieces) else None

        processor = self.processor
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            bos_token=piece_of(processor.bos_id()),
            eos_token=piece_of(processor.eos_id()),
            unk_token=piece_of(processor.unk_id()),
            pad_token=piece_of(processor.pad_id()),
            split_special_tokens=True,  # "<s>" in a text is characters, as for SentencePiece
            clean_up_tokenization_spaces=False,
            add_bos_token=False,
            add_eos_token=False,
        )
        if len(hf) != processor.get_piece_size():
            self.refuse(
                "the vocabulary", f"the tokenizer has {len(hf)} tokens for {processor.get_piece_size()} pieces"
            )
        return hf

    # ----------------------------------------------------------------------------------------------------------------
    def check_pieces(self):
        trainer, normalizer = self.trainer_spec, self.normalizer_spec
        if trainer.model_type not in (UNIGRAM, BPE, CHAR):
            self.refuse(
                f"trainer_spec.model_type={MODEL_TYPES.get(trainer.model_type, trainer.model_type)}",
                "only unigram, bpe and char models are supported",
            )
        if self.proto.HasField("denormalizer_spec") and self.proto.denormalizer_spec.precompiled_charsmap:
            self.refuse("denormalizer_spec", "tokenizers' decoders cannot apply a character map to decoded text")
        seen = {}
        for i, (piece, _, kind) in enumerate(self.pieces):
            if piece in seen:
                self.refuse(f"pieces {seen[piece]} and {i}", f"both are {piece!r}")
            seen[piece] = i
            if kind == UNUSED:
                self.refuse(f"piece {i} ({piece!r}) of type UNUSED", "tokenizers has no piece that is never produced")
            if kind not in (NORMAL, USER_DEFINED) and len(piece) == 1:
                self.refuse(f"piece {i} ({piece!r})", "a one-character control/unk piece would match that character")
            if kind == USER_DEFINED:
                if trainer.model_type == UNIGRAM:
                    self.refuse(
                        f"trainer_spec.user_defined_symbols ({piece!r}) in a unigram model",
                        "SentencePiece scores them in the lattice, which tokenizers cannot do",
                    )
                if trainer.treat_whitespace_as_suffix and normalizer.add_dummy_prefix:
                    self.refuse(
                        f"trainer_spec.user_defined_symbols ({piece!r}) with treat_whitespace_as_suffix",
                        "the dummy suffix would be part of a symbol written alone",
                    )
                if " " in piece or SPACE in piece:
                    self.refuse(
                        f"trainer_spec.user_defined_symbols ({piece!r})",
                        "a symbol with whitespace is matched before escaping, which tokenizers cannot mimic",
                    )
        normal = {piece for piece, _, kind in self.pieces if kind == NORMAL}
        for piece, _, kind in self.pieces:
            # SentencePiece merges (BPE) or scores (unigram: the <unk> penalty) a character that is no piece inside a
            # longer piece; tokenizers makes it <unk>/bytes first. Trained models never have such pieces.
            if kind == NORMAL and any(c not in normal for c in piece):
                bad = next(c for c in piece if c not in normal)
                self.refuse(f"piece {piece!r}", f"its character {bad!r} is not a piece of its own")
        unk = [i for i, (_, _, kind) in enumerate(self.pieces) if kind == UNKNOWN]
        if len(unk) != 1:
            self.refuse("the pieces", f"{len(unk)} unknown pieces (SentencePiece needs exactly one)")
        self.unk_id = unk[0]
        if SPACE in trainer.unk_surface and (normalizer.add_dummy_prefix or normalizer.remove_extra_whitespaces):
            self.refuse("trainer_spec.unk_surface", f"{trainer.unk_surface!r} holds {SPACE!r}")
        if not self.strict:
            return
        # strict=True: also refuse what is reproduced on all but some texts (see the module docstring).
        if trainer.model_type == UNIGRAM:
            self.refuse(
                "trainer_spec.model_type=unigram (strict=True)",
                "tokenizers adds the scores in float64 and "
                "SentencePiece in float32, so exact ties between segmentations may be resolved differently",
            )
        if self.user_defined and normalizer.add_dummy_prefix:
            self.refuse(
                "trainer_spec.user_defined_symbols with add_dummy_prefix (strict=True)",
                "a text that is exactly one symbol gets no dummy prefix",
            )
        if (
            trainer.treat_whitespace_as_suffix
            and normalizer.add_dummy_prefix
            and normalizer.remove_extra_whitespaces
            and normalizer.precompiled_charsmap
        ):
            self.refuse(
                "treat_whitespace_as_suffix with a character map (strict=True)",
                "a text the map deletes entirely gets no dummy suffix",
            )
        scores = [score for piece, score, kind in self.pieces if kind == NORMAL and len(piece) > 1]
        if trainer.model_type == BPE and len(set(scores)) != len(scores):
            self.refuse(
                "the piece scores (strict=True)",
                "two merged pieces share a score, and SentencePiece orders "
                "their merges by position where tokenizers orders them by rank",
            )

    # ----------------------------------------------------------------------------------------------------------------
    def bpe(self):
        from tokenizers import models

        # A char model is BPE without merges: one piece (or <unk>, or bytes) per character.
        mergeable = {piece: i for i, (piece, _, kind) in enumerate(self.pieces) if kind == NORMAL}
        if self.trainer_spec.model_type == CHAR:
            mergeable = {}
        ranked = []
        for piece, i in mergeable.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in mergeable and right in mergeable:
                    # SentencePiece merges the adjacent pair whose joint piece scores best (leftmost on ties).
                    ranked.append((-self.pieces[i][1], i, cut, left, right))
        ranked.sort()
        vocab = {piece: i for i, (piece, _, _) in enumerate(self.pieces)}
        return models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=self.pieces[self.unk_id][0],
            fuse_unk=True,
            byte_fallback=self.trainer_spec.byte_fallback,
            dropout=None,
        )

    def unigram(self):
        from tokenizers import models

        normal = {piece: score for piece, score, kind in self.pieces if kind == NORMAL}
        if not normal:
            self.refuse("the pieces", "the unigram model has no normal piece")
        # Control, unk and byte pieces are no candidates for SentencePiece's Viterbi, but tokenizers matches every
        # vocabulary entry. So they get a score that loses to spelling them with one-character pieces, and
        # `pre_tokenizer` isolates the characters that are no pieces (no word then holds such a piece and them). The
        # unk penalty this score lowers is the same on every path (no normal piece holds an unknown character:
        # check_pieces), so it changes no choice.
        longest = max((len(piece) for piece, _, kind in self.pieces if kind != NORMAL), default=1)
        never = (min(min(normal.values()), 0.0) - 1.0) * 10 * (longest + 1)
        vocab = [(piece, score if kind == NORMAL else never) for piece, score, kind in self.pieces]
        return models.Unigram(vocab, self.unk_id, self.trainer_spec.byte_fallback)

    # ----------------------------------------------------------------------------------------------------------------
    def normalizers(self, space: str) -> list:
        """SentencePiece's Normalizer::Normalize: the character map, then whitespace handling (only U+0020 is
        whitespace; the map turns tabs/newlines into spaces where it does, e.g. nmt_nfkc)."""
        from tokenizers import Regex, normalizers

        spec = self.normalizer_spec
        suffix = self.trainer_spec.treat_whitespace_as_suffix
        strip = spec.remove_extra_whitespaces
        steps = []
        if self.user_defined:
            # tokenizers matches a user-defined symbol in the normalized text as the normalizer writes the symbol
            # alone; so a text that is exactly one symbol gets no dummy prefix (SentencePiece writes "▁" before it).
            symbols = "|".join(map(_escape, self.user_defined))
            prefix = normalizers.Replace(Regex(rf"\A(?=[\s\S])(?!(?:{symbols})\z)"), space)
        else:
            prefix = normalizers.Prepend(space)  # not to an empty text
        if spec.add_dummy_prefix and not strip:
            # Before the map: SentencePiece adds it for any non-empty text, even one the map deletes entirely.
            steps.append(normalizers.Replace(Regex(r"(?<=[\s\S])\z"), space) if suffix else prefix)
        if spec.precompiled_charsmap:
            steps += self.charsmap_normalizers()
        if strip:
            steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A +"), "")]
            # After escaping, SentencePiece strips trailing U+2581s, spaces or not; then adds a dummy suffix to any
            # text that was not all spaces (one of "\u2581"s only gets it too).
            trailing = f"[ {SPACE}]+" if space == SPACE else " +"
            if spec.add_dummy_prefix and suffix:
                steps += [
                    normalizers.Replace(Regex(r"(?<=[\s\S])\z"), space),
                    normalizers.Replace(Regex(f"{trailing}(?={_escape(space)}\\z)"), ""),
                ]
            else:
                steps.append(normalizers.Replace(Regex(trailing + r"\z"), ""))
        if space == SPACE:
            steps.append(normalizers.Replace(" ", SPACE))
        if spec.add_dummy_prefix and strip and not suffix:
            steps.append(prefix)
        return steps

    def charsmap_normalizers(self) -> list:
        return _charsmap_normalizers(self.proto, self, self.strict)

    def pre_tokenizer(self, space: str):
        """Splits that no piece spans (so they change nothing, and make encoding faster)."""
        from tokenizers import Regex, pre_tokenizers

        steps = []
        normal = [piece for piece, _, kind in self.pieces if kind == NORMAL]
        w = re.escape(space)
        suffix = self.trainer_spec.treat_whitespace_as_suffix
        shape = re.compile(f"[^{w}]*{w}*" if suffix else f"{w}*[^{w}]*")
        if all(shape.fullmatch(piece) for piece in normal):  # else e.g. split_by_whitespace=false: one word
            o = _escape(space)
            word = f"[^{o}]+{o}*|{o}+" if suffix else f"{o}*[^{o}]+|{o}+"
            steps.append(pre_tokenizers.Split(Regex(word), behavior="isolated"))
        known = {c for piece in normal for c in piece}
        special = "".join(piece for piece, _, kind in self.pieces if kind != NORMAL)
        if self.trainer_spec.model_type == UNIGRAM and any(c not in known for c in special):
            # Runs of characters that are no pieces (unk or bytes either way), so no special piece matches.
            steps.append(pre_tokenizers.Split(Regex(f"[^{_char_class(known)}]+"), behavior="isolated"))
        return pre_tokenizers.Sequence(steps) if len(steps) > 1 else (steps[0] if steps else None)

    def decoder(self):
        """SentencePieceProcessor::Decode (see the module docstring)."""
        from tokenizers import Regex, decoders

        spec, trainer = self.normalizer_spec, self.trainer_spec
        steps = []
        controls = [piece for piece, _, kind in self.pieces if kind == CONTROL]
        if controls:  # invisible, also when a caller keeps special tokens
            steps.append(decoders.Replace(Regex(r"\A(?:" + "|".join(map(_escape, controls)) + r")\z"), ""))
        # The first piece(s) lose their leading U+2581 (the dummy prefix) if add_dummy_prefix or
        # remove_extra_whitespaces: keep it as a marker until the pieces are joined and we know what came first.
        drop_first = spec.add_dummy_prefix or spec.remove_extra_whitespaces
        steps.append(decoders.Replace(Regex(f"(?<=[\\s\\S]){SPACE}") if drop_first else SPACE, " "))
        steps.append(
            decoders.Replace(Regex(r"\A" + _escape(self.pieces[self.unk_id][0]) + r"\z"), trainer.unk_surface)
        )
        if trainer.byte_fallback:
            # SentencePiece decodes a run of byte pieces character by character (U+FFFD for each byte that starts no
            # valid character), ByteFallback all or nothing. So a byte that is never valid UTF-8 becomes U+FFFD
            # first, and ASCII bytes (always a character) are hidden from a first ByteFallback as "<0y..>" (splitting
            # the runs there) and decoded by a second one.
            hide = next(
                f"<0{c}"
                for c in "yzwvu"
                if not any(re.fullmatch(f"<0{c}[0-7][0-9A-F]>", p) for p, _, _ in self.pieces)
            )
            ascii_byte = "(?=[0-7][0-9A-F]>\\z)"
            steps += [
                decoders.Replace(Regex(r"\A<0x(?:C[01]|F[5-9A-F])>\z"), "\ufffd"),
                decoders.Replace(Regex(r"\A<0x" + ascii_byte), hide),
                decoders.ByteFallback(),
                decoders.Replace(Regex(r"\A" + _escape(hide) + ascii_byte), "<0x"),
            ]
        steps += [decoders.ByteFallback(), decoders.Fuse()]
        if drop_first:
            # Every piece while nothing is written drops one (remove_extra_whitespaces), else only the first.
            first = f"\\A{SPACE}+" if spec.remove_extra_whitespaces else f"\\A{SPACE}"
            steps.append(decoders.Replace(Regex(first), ""))
            steps.append(decoders.Replace(SPACE, " "))
        return decoders.Sequence(steps)


# --------------------------------------------------------------------------------------------------------------------
# The character map
#
# SentencePiece normalizes with a trie of rules (precompiled_charsmap): at each position the longest matching rule
# replaces its source, else the character is kept. tokenizers' `Precompiled` normalizer reads the same trie but applies
# it per grapheme cluster (a whole cluster replaced by its shortest matching rule, or character by character), which
# drops accents after a mapped character ("Ａ\u0301" -> "A", NFD Vietnamese loses its second accent) and misses
# multi-character rules in long clusters ("ｶﾞ" -> "カ\u3099"). So a control character is put between every two
# characters (one character per cluster: the map applies character by character; a separator the map deletes goes
# with it, else `_per_character` removes them), then NFC recomposes what the multi-character rules compose (the rules
# of nmt_nfkc and nfkc are NFKC of their sources).
# Every rule is checked against SentencePiece at conversion; what tokenizers' (older) Unicode tables do not compose
# gets an explicit replacement, and anything still different refuses the conversion.


def _charsmap_rules(blob: bytes) -> dict[bytes, bytes]:
    """Every (source -> replacement) rule of a precompiled_charsmap:
    <u32 size of the trie><darts-clone double array><replacements, each ended by \\0>."""
    return dict(_charsmap_rules_cached(bytes(blob)))


@lru_cache(maxsize=4)
def _charsmap_rules_cached(blob: bytes) -> tuple:
    import numpy as np

    (size,) = struct.unpack("<I", blob[:4])
    units = np.frombuffer(blob[4 : 4 + size], dtype="<u4").astype(np.int64)
    strings = blob[4 + size :]

    def offset(unit):
        return (unit >> 10) << ((unit & (1 << 9)) >> 6)

    labels = np.arange(1, 256, dtype=np.int64)
    rules = []
    bases, keys = np.array([offset(units[0])]), [b""]  # the nodes of one depth: where their children are, their keys
    while len(keys):
        next_bases, next_keys = [], []
        for chunk in range(0, len(keys), 2048):
            children = bases[chunk : chunk + 2048, None] ^ labels[None, :]
            inside = children < len(units)
            found = inside & ((units[np.where(inside, children, 0)] & ((1 << 31) | 0xFF)) == labels[None, :])
            parent, label = np.nonzero(found)
            child = children[parent, label]
            child_units = units[child]
            positions = child ^ offset(child_units)
            leaves = (child_units >> 8) & 1
            values = units[np.where(leaves == 1, positions, 0)] & ((1 << 31) - 1)
            for p, char, position, leaf, value in zip(
                (parent + chunk).tolist(), (label + 1).tolist(), positions.tolist(), leaves.tolist(), values.tolist()
            ):
                source = keys[p] + bytes((char,))
                if leaf:  # the rule's replacement starts at the leaf's value
                    rules.append((source, strings[value : strings.index(b"\0", value)]))
                next_keys.append(source)
            next_bases.append(positions)
        bases = np.concatenate(next_bases) if next_bases else np.array([], dtype=np.int64)
        keys = next_keys
    return tuple(rules)


@lru_cache(maxsize=1)
def _canonical_decomposables() -> tuple:
    return tuple(
        chr(c)
        for c in range(0x110000)
        if not 0xD800 <= c < 0xE000 and unicodedata.decomposition(chr(c))[:1] not in ("", "<")
    )


def _charsmap_normalizers(proto, converter, strict: bool) -> list:
    from tokenizers import normalizers

    setting = f"normalizer_spec.precompiled_charsmap (name {proto.normalizer_spec.name!r})"
    blob = proto.normalizer_spec.precompiled_charsmap
    plan = _charsmap_plan(bytes(blob))
    if isinstance(plan, str):
        converter.refuse(setting, plan)
    breaker, nfc, fixes = plan
    if nfc and strict:
        converter.refuse(
            setting + " (strict=True)",
            "it composes characters, which is reproduced only for text whose combining marks are in canonical order",
        )
    steps = _per_character(blob, breaker)
    if nfc:
        steps.append(normalizers.NFC())
    steps += [normalizers.Replace(have, want) for have, want in fixes]
    normalize = normalizers.Sequence(steps).normalize_str
    for symbol in converter.user_defined:  # matched in the normalized text (see _Converter.build)
        if normalize(symbol) != symbol:
            converter.refuse(f"trainer_spec.user_defined_symbols ({symbol!r})", "the character map changes it")
    return steps


def _per_character(blob: bytes, breaker: str) -> list:
    """The map applied character by character: `breaker` between every two characters keeps each in a grapheme cluster
    of its own. A map that deletes the breaker is done; else (a map that deletes nothing, so between two characters
    there is one breaker, and around k of them in the text 2k+1) one breaker of each run inside the text goes, and
    the runs are halved."""
    from tokenizers import Regex, normalizers

    steps = [normalizers.Replace(Regex(r"(?<=[\s\S])(?=[\s\S])"), breaker), normalizers.Precompiled(blob)]
    if not _charsmap_deletes(blob, breaker):
        b = _escape(breaker)
        steps += [
            normalizers.Replace(Regex(f"(?<=[^{b}]){b}(?={b}*[^{b}])"), ""),
            normalizers.Replace(breaker * 2, breaker),
        ]
    return steps


def _charsmap_deletes(blob: bytes, char: str) -> bool:
    return dict(_charsmap_rules_cached(bytes(blob))).get(char.encode()) == b""


@lru_cache(maxsize=4)
def _charsmap_plan(blob: bytes):
    """(separator the map deletes, whether NFC follows, explicit (text, replacement) fixes) that reproduce every rule
    of the map, or why that is impossible."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import normalizers

    try:
        rules = {source.decode(): target.decode() for source, target in _charsmap_rules(blob).items()}
    except Exception as error:
        return f"its rules cannot be read ({type(error).__name__}: {error})"
    if rules.get(SPACE, " ") != " " or " " in rules:
        return f'it maps {SPACE!r} or " " to something else than a space'
    if any("  " in target for target in rules.values()):
        return "a rule writes two spaces, which remove_extra_whitespaces keeps only at its start"
    in_long_rules = {c for source in rules if len(source) > 1 for c in source}
    breaker = next((c for c in _BREAKERS if rules.get(c) == "" and c not in in_long_rules), None)
    if breaker is None and "" not in rules.values():  # a map that deletes nothing (nfkc): a separator it keeps
        breaker = next((c for c in _BREAKERS if c not in rules and c not in in_long_rules), None)
    if breaker is None:
        return "the map deletes characters but no control character, which the conversion needs as a separator"
    used = in_long_rules | set(rules) | {c for target in rules.values() for c in target}
    separator = next((c for c in "|#@~^`;\ue000\U000f0000" if c not in used and c != breaker), None)
    if separator is None:
        return "no separator character for checking its rules"

    # SentencePiece's normalization with this map alone (a minimal model, no whitespace handling).
    plain = sentencepiece_model_pb2.ModelProto()
    plain.pieces.add(piece="<unk>", score=0.0, type=UNKNOWN)
    plain.pieces.add(piece="a", score=0.0, type=NORMAL)
    plain.trainer_spec.model_type = UNIGRAM
    plain.normalizer_spec.precompiled_charsmap = blob
    plain.normalizer_spec.add_dummy_prefix = False
    plain.normalizer_spec.remove_extra_whitespaces = False
    plain.normalizer_spec.escape_whitespaces = False
    try:
        reference = sentencepiece.SentencePieceProcessor(model_proto=plain.SerializeToString())
    except Exception as error:
        return f"SentencePiece cannot normalize with it alone ({type(error).__name__}: {error})"

    references = {}

    def differences(steps, probes):
        """(probe, tokenizers' normalization, SentencePiece's) where they differ; None if the separator changed."""
        text = separator.join(probes)
        if text not in references:
            references.clear()
            references[text] = reference.normalize(text).split(separator)
        want = references[text]
        have = normalizers.Sequence(steps).normalize_str(text).split(separator)
        if len(want) != len(probes) or len(have) != len(probes):
            return None
        return [(probe, h, w) for probe, h, w in zip(probes, have, want) if h != w]

    # Every rule's source, every character Unicode decomposes canonically (NFC may change it where no rule does), and
    # the separator in the text.
    probes = sorted(
        set(rules)
        | set(_canonical_decomposables())
        | {
            breaker * n + "a" * m + breaker * k + "b"[:j]
            for n in range(3)
            for m in range(2)
            for k in range(3)
            for j in range(2)
        }
        - {""}
    )
    per_character = _per_character(blob, breaker)
    wrong = differences(per_character, probes)
    if wrong == []:
        return breaker, False, ()
    # Multi-character rules that compose (nmt_nfkc's and nfkc's are NFKC of their sources): recompose with NFC, and
    # replace explicitly what tokenizers' (older) Unicode tables do not compose.
    wrong = differences(per_character + [normalizers.NFC()], probes)
    fixes = {}
    for _, have, want in wrong or ():
        if fixes.get(have, want) != want or not have:
            return f"two of its rules give {have!r} differently"
        fixes[have] = want
    if wrong is None or len(fixes) > 500:
        return f"{len(fixes) if wrong is not None else 'its'} rules differ from NFC"
    if not fixes:
        return breaker, True, ()
    fixes = tuple(sorted(fixes.items(), key=lambda item: (-len(item[0]), item[0])))
    steps = per_character + [normalizers.NFC()] + [normalizers.Replace(have, want) for have, want in fixes]
    # A replacement also applies where its text comes from elsewhere: check those texts too.
    wrong = differences(steps, sorted(set(probes) | {text for fix in fixes for text in fix}))
    if wrong is None or wrong:
        example = f", e.g. {wrong[0][0]!r} -> {wrong[0][1]!r}, not {wrong[0][2]!r}" if wrong else ""
        return f"{len(wrong) if wrong else 'its'} rules differ{example}"
    return breaker, True, fixes
