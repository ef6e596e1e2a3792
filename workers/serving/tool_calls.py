"""Tool calling: how tools reach the model, the grammar its calls must follow, and calls read back from its text.

One format end to end, Hermes-style tags around one JSON object per call, which most open chat models that call
tools were trained on (Qwen 2.5 and 3, Hermes, SmolLM3)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools (it mentions ``tools``) gets them, and the messages' calls and results, in
Hugging Face's conventions; any other template gets them through ``DEFAULT_INSTRUCTIONS`` in the system message,
with earlier calls written back in the tags and results as ``<tool_response>`` user turns.

Decoding is constrained to the format (workers/serving/guided.py): with ``tool_choice`` ``required`` or a named
function the reply is nothing but calls; with ``auto`` the text is free until the model opens a ``<tool_call>``
tag, and from there the call must name one of the tools and carry arguments valid against its schema. So every
call parses, and ``ToolCallParser`` turns the text into OpenAI's ``tool_calls`` as it streams.
"""

from __future__ import annotations

import hashlib
import json

from switchyard.shared.messages import ChatMessage, ResponseFormat, ToolSpec, ToolUse
from switchyard.workers.serving.guided import with_json_style

OPEN, CLOSE = "<tool_call>", "</tool_call>"

DEFAULT_INSTRUCTIONS = """# Tools

You can call functions to help with the user's request. These are the functions, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments between <tool_call> tags, one call per tag:
<tool_call>
{{"name": "function name", "arguments": {{"argument name": "value"}}}}
</tool_call>
The results come back between <tool_response> tags."""


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _function_json(tool: ToolSpec) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters or
                {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def _call_text(name: str, arguments: str) -> str:
    call = {"name": name, "arguments": _loads_or_text(arguments)}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def chat_messages(tokenizer, messages: list[ChatMessage], tool_use: ToolUse | None) -> tuple[list[dict], list | None]:
    """The messages (and the ``tools`` argument) to render with ``tokenizer``'s chat template."""
    tools = tool_use.tools if tool_use is not None and tool_use.choice != "none" else []
    if template_knows_tools(tokenizer):
        out = []
        for m in messages:
            msg: dict = {"role": m.role, "content": m.content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": _loads_or_text(c.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out, [_function_json(t) for t in tools] or None
    out = []
    for m in messages:
        if m.role == "tool":  # templates without tools know no tool role: the result comes back as the user's
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif m.tool_calls:
            calls = "\n".join(_call_text(c.name, c.arguments) for c in m.tool_calls)
            out.append({"role": m.role, "content": f"{m.content}\n{calls}" if m.content else calls})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        listing = "\n".join(json.dumps(_function_json(t), ensure_ascii=False) for t in tools)
        instructions = DEFAULT_INSTRUCTIONS.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, None


def _loads_or_text(arguments: str):
    """The arguments as JSON, or as the client sent them when they are not: the model sees what it was told."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_grammar(tool_use: ToolUse, response_format: ResponseFormat | None = None) -> str | None:
    """The Lark grammar (llguidance's dialect) the reply must follow, or None when it is free text.

    With ``auto`` the reply is content or calls; content is free text (and the calls may follow some), or with a
    JSON ``response_format`` a JSON value of it (and then calls come alone)."""
    if tool_use.choice == "none" or not tool_use.tools:
        return None
    tools = tool_use.tools
    if tool_use.choice == "function":
        tools = [t for t in tools if t.name == tool_use.function]
    alternatives = [{
        "type": "object",
        "properties": {"name": {"const": t.name},
                       "arguments": t.parameters or {"type": "object", "properties": {}}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    call_schema = with_json_style(alternatives[0] if len(alternatives) == 1 else {"oneOf": alternatives})
    # A named function is called once (OpenAI: "forces the model to call that function").
    more = f' ("\\n{OPEN}" body)*' if tool_use.parallel and tool_use.choice != "function" else ""
    rules = [
        "%llguidance {}",
        f"body: \"\\n\" %json {json.dumps(call_schema)} \"\\n{CLOSE}\"",
        f"calls: body{more}",
    ]
    if tool_use.choice != "auto":
        return "\n".join([*rules, f'start: "{OPEN}" calls'])
    if response_format is not None and response_format.type in ("json_object", "json_schema"):
        schema = (response_format.schema or {}) if response_format.type == "json_schema" else {"type": "object"}
        return "\n".join([*rules, f'start: %json {json.dumps(with_json_style(schema))} | "{OPEN}" calls'])
    # Free text, or free text up to the first opening tag and calls from there (a lazy lexeme ends at the first
    # tag, so the text before a call cannot hold one unchecked).
    return "\n".join([*rules, "start: TEXT | opened calls", f'opened[lazy]: TEXT "{OPEN}"', r"TEXT: /(.|\n)*/"])


def call_id(request_id: str, choice: int, index: int) -> str:
    """A call's id: the same on every worker for the same call, so a replayed stream names it the same."""
    return "call_" + hashlib.sha256(f"{request_id}:{choice}:{index}".encode()).hexdigest()[:24]
