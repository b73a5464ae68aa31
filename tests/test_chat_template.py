"""Chat templates render exactly as transformers' ``apply_chat_template(..., tokenize=False)``.

The oracle is a transformers tokenizer built around the same vocabulary and template,
so its whole path (message normalisation, special-token variables, the Jinja
environment) is compared, not just Jinja itself.
"""

from __future__ import annotations

import pytest

from polyengine.errors import InvalidRequest
from polyengine.models import ChatTemplateError, Tokenizer
from polyengine.models.presets import byte_tokenizer
from test_models_oracle import CONVERSATIONS

transformers = pytest.importorskip("transformers")

LLAMA31_LIKE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

FEATURES = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m.tool_calls is defined %}CALLS {{ m.tool_calls | tojson }}
    {% endif %}
    {% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}
    {% generation %}{{ m.role }}={{ m.content }}{% endgeneration %}

    {% if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b='<&>', c='日本') | tojson }} {{ {'k': [1, 2]} | tojson(sort_keys=True, separators=(',', ':')) }}
bos={{ bos_token }} eos={{ eos_token }} pad={{ pad_token }} extra={{ extra_var | default('none') }}
{%- if add_generation_prompt %}
<|assistant_start|>
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "a <b>calculator</b> & more",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]

MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Unicode café 日本 😀 and <html> & \"quotes\"", "tool_calls": None},
    {"role": "skip", "content": "hidden"},
    {"role": "assistant", "content": "  ok  ", "tool_calls": [{"name": "calc", "arguments": {"expr": "1+1"}}],
     "reasoning": "think <hard>"},
    {"role": "user", "content": "again"},
    {"role": "user", "content": "cut by break"},
]


def _pair(template: str) -> tuple[Tokenizer, object]:
    ours = byte_tokenizer()
    ours = Tokenizer(ours.backend, special_tokens=ours.special_tokens_map, chat_template=template)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    hf.chat_template = template
    return ours, hf


@pytest.mark.parametrize("template", [LLAMA31_LIKE, FEATURES], ids=["llama31-like", "features"])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_renders_like_transformers(template, gen, with_tools):
    ours, hf = _pair(template)
    messages = MESSAGES if template is FEATURES else [m for m in MESSAGES if m["role"] != "skip"]
    kwargs = {"tools": TOOLS} if with_tools else {}
    if template is FEATURES:
        kwargs["extra_var"] = "X"
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs) == want
    assert MESSAGES[1]["tool_calls"] is None  # the caller's messages are not modified


def test_default_model_template_renders_like_transformers(default_gguf, smollm2_oracle):
    from polyengine.models.gguf_io import read_gguf

    tok = Tokenizer.from_gguf_metadata(read_gguf(default_gguf).metadata)
    for (messages, gen), want in zip(CONVERSATIONS, smollm2_oracle["chats"]):
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want


def test_preset_template():
    tok = byte_tokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert text == "<|bos|><|system_start|>s<|system_end|><|user_start|>hi<|user_end|><|assistant_start|>"
    with pytest.raises(ChatTemplateError, match="unknown role wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('Conversation roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{{ messages.append({'role': 'x'}) }}", "refused"),
        ("{% set ns = namespace(_secret=1) %}", "refused"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),
        ("{{ messages[5]['content'] }}", "chat template"),
    ],
)
def test_template_errors_are_polyengine_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match) as info:
        tok = byte_tokenizer()
        Tokenizer(tok.backend, chat_template=template).apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, InvalidRequest)


def test_bad_conversations():
    tok = byte_tokenizer()
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="dicts"):
        tok.apply_chat_template(["hello"])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "hi"}])
