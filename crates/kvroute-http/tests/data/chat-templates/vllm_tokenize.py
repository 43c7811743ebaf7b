"""Writes vllm_tokenize.json: the prompt token ids a real vLLM 0.32 engine ran for chat
completions with tools, tool calls, documents, template kwargs, reasoning_effort and
continue_final_message, for each template of templates.json. The ids are those of the
response's `prompt_logprobs` (one per position but the first, which the engine's `/tokenize`
gives; `/tokenize` alone is not enough: it passes neither `documents` nor `reasoning_effort` to
the template). The engine serves the repository's BOS model (`scripts/real-vllm/setup.sh`) and
is started with `--trust-request-chat-template`, so each request names its template.
Run: python3 vllm_tokenize.py URL (the engine's base URL). The Rust test parses each body
(without its `chat_template`) and compares the ids.
"""
import json, os, sys, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
base = sys.argv[1].rstrip("/")
templates = json.load(open(os.path.join(HERE, "templates.json")))

weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
bare = {"type": "function", "function": {"name": "noop"}, "extra": 1}
strict = {"function": {"name": "exact", "strict": True, "parameters": {"type": "object"}, "junk": "x"}}
call = lambda args: {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
turns = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris", "days": 2}')]},
         {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
bodies = [
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [weather, bare]},
    {"messages": turns, "tools": [weather]},
    {"messages": turns[:1] + [{"role": "assistant", "content": "", "tool_calls": [call("")]},
                              {"role": "assistant", "content": "", "tool_calls": [call("not json")]},
                              {"role": "assistant", "content": "ok", "tool_calls": []}], "tools": [strict]},
    {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "Sum up"}], "documents": [{"title": "A", "text": "b c"}]},
    {"messages": [{"role": "system", "content": "s", "name": "sys1", "foo": 1},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "thinking done", "reasoning": "r"},
                  {"role": "user", "content": []}]},
    {"messages": [{"role": "user", "content": "Complete"}, {"role": "assistant", "content": "It is"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "  /go fast "}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Think?"}], "reasoning_effort": "none"},
    {"messages": [{"role": "user", "content": "Think!"}], "reasoning_effort": "low",
     "chat_template_kwargs": {"enable_thinking": False}},
]
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        return 200, json.load(urllib.request.urlopen(req))
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


cases = []
for name, template in templates.items():
    for body in bodies:
        # `tool_choice` "none": the engine runs without a tool parser; the tools still reach the
        # template (unless the server excludes them, which it does not by default).
        request = dict(body, model="tiny", chat_template=template)
        if "tools" in body:
            request["tool_choice"] = "none"
        status, answer = post("/v1/chat/completions", dict(request, max_tokens=1, prompt_logprobs=0))
        if status != 200:
            cases.append({"template": name, "body": body, "error": answer})
            continue
        _, first = post("/tokenize", request)
        ids = [first["tokens"][0]] + [int(next(iter(p))) for p in answer["prompt_logprobs"][1:]]
        assert len(ids) == answer["usage"]["prompt_tokens"], (name, body)
        cases.append({"template": name, "body": body, "tokens": ids})
json.dump({"vllm": "0.32.0", "cases": cases}, open(os.path.join(HERE, "vllm_tokenize.json"), "w"), indent=1, ensure_ascii=False)
print(len(cases), "cases,", sum("error" in c for c in cases), "refused")
