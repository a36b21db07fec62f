"""The Python API as a vLLM user calls it: LLM.chat's chat_template / add_generation_prompt /
continue_final_message, LLM.get_tokenizer, and RequestOutput's prompt, finished, stop_reason and
prompt_logprobs."""

import pytest

from batchllm import LLM, SamplingParams
from batchllm.engine.request_limits import NoTokenizerError

pytest_plugins = ["model_fixtures"]

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HI = [{"role": "user", "content": "Hi"}]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=1024)


def test_stop_reason_is_the_stop_token_id_and_none_at_length(tiny_llm):
    (free,) = tiny_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert free.finished and free.prompt_logprobs is None and free.prompt is None
    assert (free.outputs[0].finish_reason, free.outputs[0].stop_reason) == ("length", None)
    tokens = free.outputs[0].token_ids
    stop_id = tokens[2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id])
    (stopped,) = tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens[:tokens.index(stop_id) + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop_id)


def test_a_model_without_tokenizer_says_so(tiny_llm):
    with pytest.raises(NoTokenizerError, match="random:tiny has no tokenizer"):
        tiny_llm.get_tokenizer()
    with pytest.raises(NoTokenizerError, match="has no tokenizer"):
        tiny_llm.chat(HI)


def test_chat_prompt_is_the_rendered_conversation(default_llm):
    hf = default_llm.get_tokenizer()
    assert hf is default_llm.engine.tokenizer.hf
    (out,) = default_llm.chat(HI, GREEDY, use_tqdm=False)
    rendered = hf.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == hf(rendered, add_special_tokens=False).input_ids
    assert out.finished and out.prompt_logprobs is None


def test_chat_template_replaces_the_models(default_llm):
    (out,) = default_llm.chat(HI, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt == "user: Hi\nassistant:"
    hf = default_llm.get_tokenizer()
    assert out.prompt_token_ids == hf("user: Hi\nassistant:", add_special_tokens=False).input_ids
    (bare,) = default_llm.chat(HI, GREEDY, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False)
    assert bare.prompt == "user: Hi\n"


def test_continue_final_message_leaves_the_last_message_open(default_llm):
    conversation = [*HI, {"role": "assistant", "content": "The capital of France is"}]
    (out,) = default_llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                              continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    (closed,) = default_llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt.endswith("The capital of France is<|im_end|>\n")
    with pytest.raises(ValueError, match="cannot both be true .*add_generation_prompt=False"):
        default_llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)


def test_stop_reason_is_the_stop_string_and_none_at_eos(default_llm):
    (out,) = default_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=30, stop=[" 9", " 8"]),
                                  use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (" 6, 7,", "stop", " 8")
    (eos,) = default_llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64),
                              use_tqdm=False)
    assert eos.outputs[0].token_ids[-1] in default_llm.engine.eos_token_ids
    assert (eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == ("stop", None)


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(default_llm):
    hf = default_llm.get_tokenizer()
    say_hello = [{"role": "user", "content": "Say hello."}]
    base = SamplingParams(temperature=0, max_tokens=64)
    (plain,) = default_llm.chat(say_hello, base, use_tqdm=False)
    (kept,) = default_llm.chat(say_hello, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                                                         include_stop_str_in_output=True), use_tqdm=False)
    token_ids = plain.outputs[0].token_ids
    assert kept.outputs[0].token_ids == token_ids and hf.decode(token_ids[-1:]) == "<|im_end|>"
    assert kept.outputs[0].text == plain.outputs[0].text + "<|im_end|>"
    # Without include_stop_str_in_output the terminating EOS is left out of the text, as in vLLM.
    (cut,) = default_llm.chat(say_hello, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False),
                              use_tqdm=False)
    assert (cut.outputs[0].text, cut.outputs[0].token_ids) == (plain.outputs[0].text, token_ids)
    # Past the EOS (ignore_eos) the special tokens the model writes stay in the text.
    (run_on,) = default_llm.chat(say_hello, SamplingParams(temperature=0, max_tokens=len(token_ids) + 8,
                                                           ignore_eos=True, skip_special_tokens=False), use_tqdm=False)
    assert run_on.outputs[0].finish_reason == "length"
    assert run_on.outputs[0].text == hf.decode(run_on.outputs[0].token_ids, skip_special_tokens=False)
    assert "<|im_end|>" in run_on.outputs[0].text
