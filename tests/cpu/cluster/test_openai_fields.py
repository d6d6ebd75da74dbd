"""The API's request fields: none silently ignored, each one that is implemented reaches the engine."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from outrider.cluster.openai_api import ChatCompletionRequest, CompletionRequest, validation_error
from outrider.cluster.openai_fields import DEFAULT_ONLY, NO_EFFECT, echoed, vllm_prompt_logprobs
from outrider.cluster.served_model import eos_token_ids
from outrider.target_worker.sequence import GrammarSpec, RequestParams, TokenLogprob

COMPLETION = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(schema, body: dict) -> tuple[str | None, str]:
    """(param, message) of the 400 the ingress would answer."""
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    error = validation_error(info.value.errors())
    assert error.status == 400
    return error.param, error.message


@pytest.mark.parametrize("field", sorted(DEFAULT_ONLY))
def test_unimplemented_fields_pass_only_at_their_default(field):
    for schema, base in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        if field in schema.model_fields:
            continue  # implemented by this endpoint (echo on completions)
        schema.model_validate(base | {field: None})
        schema.model_validate(base | {field: DEFAULT_ONLY[field]})
        other = "other" if not isinstance(DEFAULT_ONLY[field], (bool, int, float)) else 2
        if isinstance(DEFAULT_ONLY[field], bool):
            other = not DEFAULT_ONLY[field]
        param, message = refusal(schema, base | {field: other})
        assert param == field and "does not implement" in message


def test_unknown_fields_are_refused_and_labels_accepted():
    param, message = refusal(CompletionRequest, COMPLETION | {"temprature": 0.5})
    assert param == "temprature" and "unknown field" in message
    for field in NO_EFFECT:
        ChatCompletionRequest.model_validate(CHAT | {field: "anything"})


def test_sampling_fields_reach_the_engine():
    req = CompletionRequest.model_validate(
        COMPLETION
        | {
            "temperature": 0.7,
            "seed": 10,
            "min_p": 0.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": 10, "7": -100},
            "stop_token_ids": [3, 4],
            "ignore_eos": True,
            "min_tokens": 2,
            "logprobs": 3,
        }
    )
    params = req.request_params(max_tokens=8, index=2)
    assert params == RequestParams(
        max_tokens=8,
        temperature=0.7,
        min_p=0.1,
        seed=12,  # choice 2 of seed 10: each choice differs, and is reproducible
        ignore_eos=True,
        stop_token_ids=(3, 4),
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((5, 10.0), (7, -100.0)),
        logprobs=3,
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_out_of_range_values_name_their_field(body, param):
    assert refusal(CompletionRequest, COMPLETION | body)[0] == param


def test_chat_logprobs():
    assert ChatCompletionRequest.model_validate(CHAT).num_logprobs is None
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True}).num_logprobs == 0
    req = ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 5})
    assert req.request_params(4, 0).logprobs == 5
    assert refusal(ChatCompletionRequest, CHAT | {"top_logprobs": 5})[0] == "top_logprobs"
    assert refusal(ChatCompletionRequest, CHAT | {"logprobs": True, "top_logprobs": 21})[0] == "top_logprobs"


def test_prompt_logprobs_as_vllm_and_shared_with_echo():
    def params(**body):
        return CompletionRequest.model_validate(COMPLETION | body).request_params(4, 0).prompt_logprobs

    assert params() is None and params(echo=True) is None and params(logprobs=3) is None
    assert params(echo=True, logprobs=3) == 3 and params(prompt_logprobs=0) == 0
    assert params(echo=True, logprobs=1, prompt_logprobs=4) == 4  # one gathering, the wider top
    assert (
        refusal(CompletionRequest, COMPLETION | {"prompt_logprobs": 2, "stream": True})[0]
        == "prompt_logprobs"
    )
    chat = ChatCompletionRequest.model_validate(CHAT | {"prompt_logprobs": 2})
    assert chat.request_params(4, 0).prompt_logprobs == 2
    assert (
        refusal(ChatCompletionRequest, CHAT | {"prompt_logprobs": 2, "stream": True})[0] == "prompt_logprobs"
    )
    # Gathered with top 3 for echo; prompt_logprobs 1 shows the token itself and the likeliest.
    entries = (
        TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0), (7, -2.0)), rank=1),
        TokenLogprob(9, -3.0, ((6, -0.2), (7, -1.9), (8, -2.5)), rank=4),
    )
    assert vllm_prompt_logprobs(list(entries), lambda t: f"<{t}>", 1) == [
        None,
        {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "<5>"}},
        {
            "6": {"logprob": -0.2, "rank": 1, "decoded_token": "<6>"},
            "9": {"logprob": -3.0, "rank": 4, "decoded_token": "<9>"},
        },
    ]
    assert echoed(entries, None) == () and [e.top for e in echoed(entries, 2)][1] == ((6, -0.2), (7, -1.9))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body,spec",
    [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", "")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            GrammarSpec("json_schema", json.dumps(SCHEMA)),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            GrammarSpec("json_schema", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec("choice", '["a", "b"]')),
        ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", '["a", "b"]')),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_structured_output_fields(body, spec):
    assert ChatCompletionRequest.model_validate(CHAT | body).grammar() == spec
    assert CompletionRequest.model_validate(COMPLETION | body).grammar() == spec


@pytest.mark.parametrize(
    "body,field",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ],
)
def test_bad_structured_output_is_refused_by_field(body, field):
    with pytest.raises(ValueError) as info:
        ChatCompletionRequest.model_validate(CHAT | body).grammar()
    assert str(info.value).startswith(f"{field}:")


def test_every_eos_id_is_found(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert eos_token_ids({"eos_token_id": 128001}, tmp_path, tmp_path) == (128001, 128009)
    assert eos_token_ids({"eos_token_id": [1, 2]}, tmp_path / "none", tmp_path / "none") == (1, 2)
    assert eos_token_ids({}, tmp_path / "none", tmp_path / "none") == ()
