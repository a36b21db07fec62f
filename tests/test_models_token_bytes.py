"""Each token's real bytes from the vocabulary, and the OpenAI logprobs built from them: byte-level
BPE (the default model) and SentencePiece with byte fallback (a small tokenizer built here)."""

import pytest

from batchllm.io.batch_output import openai_logprobs, text_offsets, token_string
from batchllm.models.token_bytes import VocabularyBytes, gpt2_byte_decoder

pytest_plugins = ["model_fixtures"]


def _sentencepiece_tokenizer():
    """A Llama-style tokenizer: "▁" for a space, <0xNN> byte tokens, a decoder that strips the
    text's first space; "A" is both a piece (9) and a byte token (10)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xF0>": 3, "<0x9F>": 4, "<0x98>": 5, "<0x80>": 6, "▁Hello": 7,
             "▁": 8, "A": 9, "<0x41>": 10, "é": 11}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_tokens_have_their_byte_and_pieces_their_text():
    hf = _sentencepiece_tokenizer()
    vocabulary = VocabularyBytes.from_hf(hf)
    assert vocabulary.token_bytes == (b"<unk>", b"<s>", b"</s>", b"\xf0", b"\x9f", b"\x98", b"\x80", b" Hello", b" ",
                                      b"A", b"A", "é".encode())
    assert vocabulary.skipped_ids == {0, 1, 2} and vocabulary.num_stripped_spaces == 1
    token_ids = [7, 3, 4, 5, 6, 2]  # " Hello", the four bytes of U+1F600, </s>
    text = hf.decode(token_ids, skip_special_tokens=True)
    assert text == "Hello😀"  # the decoder strips the first space
    assert text_offsets(token_ids, vocabulary, text) == [0, 5, 5, 5, 5, 6]
    # skip_special_tokens=False: the special tokens are text too
    with_special = hf.decode([1, *token_ids], skip_special_tokens=False)
    assert with_special == "<s> Hello😀</s>"
    assert text_offsets([1, *token_ids], vocabulary, with_special, skip_special_tokens=False) == [0, 3, 9, 9, 9, 9, 10]
    assert [token_string(t, vocabulary) for t in token_ids] == [
        " Hello", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80", "</s>"]


def test_two_ids_with_one_string_keep_one_top_logprobs_key_each():
    vocabulary = VocabularyBytes.from_hf(_sentencepiece_tokenizer())
    # sampled 10 (<0x41>), whose string "A" is also token 9's, more likely
    shape = openai_logprobs("completion", [10], [{10: -1.0, 9: -0.5, 11: -2.0}], 2, vocabulary, "A")
    assert shape["tokens"] == ["A"] and shape["token_logprobs"] == [-1.0]
    assert shape["top_logprobs"] == [{"token_id:9": -0.5, "A": -1.0, "é": -2.0}]
    assert shape["top_logprobs"][0][shape["tokens"][0]] == shape["token_logprobs"][0]


def test_byte_level_partial_tokens_keep_their_bytes_and_distinct_strings():
    table = {byte: char for char, byte in gpt2_byte_decoder().items()}
    assert len(table) == 256 and table[ord(" ")] == "Ġ" and table[ord("A")] == "A"
    pieces = [b"\xf0\x9f", b"\x8c", b"\xaa", b"\xb1", b" x"]
    vocabulary = VocabularyBytes(tuple(pieces), frozenset())
    entries = [{0: -0.1, 4: -3.0}, {1: -0.2, 3: -2.0}, {2: -0.3, 3: -1.5}]
    chat = openai_logprobs("chat", [0, 1, 2], entries, 1, vocabulary, "🌪")["content"]
    assert [c["bytes"] for c in chat] == [[0xF0, 0x9F], [0x8C], [0xAA]]
    assert bytes(b for c in chat for b in c["bytes"]).decode() == "🌪"
    assert [c["token"] for c in chat] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\xaa"]
    completion = openai_logprobs("completion", [0, 1, 2], entries, 1, vocabulary, "🌪")
    assert completion["top_logprobs"][1] == {"bytes:\\x8c": -0.2, "bytes:\\xb1": -2.0}  # no collapse to "�"
    assert completion["text_offset"] == [0, 0, 0]


def test_a_cut_text_keeps_offsets_inside_it():
    vocabulary = VocabularyBytes((b"ab", b"cd", b"ef"), frozenset())
    assert text_offsets([0, 1, 2], vocabulary, "abc") == [0, 2, 3]  # cut at a stop string inside "cd"


def test_without_a_tokenizer_tokens_are_token_ids_and_bytes_null():
    chat = openai_logprobs("chat", [5], [{5: -0.5, 7: -0.25}], 2, None, "")["content"][0]
    assert chat == {"token": "token_id:5", "logprob": -0.5, "bytes": None, "top_logprobs": [
        {"token": "token_id:7", "logprob": -0.25, "bytes": None}, {"token": "token_id:5", "logprob": -0.5,
                                                                    "bytes": None}]}
    completion = openai_logprobs("completion", [5, 7], [{5: -0.5}, {7: float("-inf")}], 0, None, "")
    assert completion == {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, -9999.0],
                          "top_logprobs": [{"token_id:5": -0.5}, {"token_id:7": -9999.0}], "text_offset": [0, 0]}


@pytest.mark.default_model
def test_default_vocabulary_bytes_decode_as_each_token_does(session_default_llm):
    tokenizer = session_default_llm.engine.tokenizer
    vocabulary = tokenizer.vocabulary
    hf = tokenizer.hf
    assert len(vocabulary.token_bytes) == len(hf) == 49152 and vocabulary.num_stripped_spaces == 0
    assert vocabulary.skipped_ids == set(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, ...
    texts = hf.batch_decode([[t] for t in range(len(hf))])
    assert [t for t, text in enumerate(texts) if t not in vocabulary.skipped_ids
            and text != vocabulary.token_bytes[t].decode("utf-8", "replace")] == []
    assert vocabulary.token_bytes[10813] == b"\xf0\x9f"  # half an emoji: decoding it alone gives U+FFFD
