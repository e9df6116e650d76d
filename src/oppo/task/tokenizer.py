"""A word-level tokenizer for the built-in tasks, built with the ``tokenizers`` library.

Every word and punctuation mark of the task's vocabulary is one token. Special tokens, always
with these ids:

    <pad> = 0    <bos> = 1    <eos> = 2    <unk> = 3

``tokenizer(text)`` adds ``<bos>`` in front (a template post-processor, like Llama's), and
never adds ``<eos>``: the policy emits it. Tokenise a response alone with
``add_special_tokens=False``. Input is lower-cased and split on whitespace and punctuation.
Decoding joins tokens with spaces and drops the space before ``. , ! ?`` (the ``WordPiece``
decoder's clean-up; the vocabulary has no ``##`` pieces and no apostrophes, so nothing else in
that clean-up applies), which is exactly ``text.detokenize``: decode(encode(t)) == t for task
text.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_tokenizer(words: list[str], model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` over ``words`` (order kept; ids start after the specials)."""
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        if w in vocab:
            continue
        if w != w.lower() or any(ch.isspace() for ch in w):
            raise ValueError(f"vocabulary words must be lower case without spaces: {w!r}")
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # marks them special: skipped when decoding
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id, fast.unk_token_id) == (
        PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    return fast
