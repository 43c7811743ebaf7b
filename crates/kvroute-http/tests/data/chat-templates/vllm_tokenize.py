"""Writes vllm_tokenize.json: the token ids a real vLLM 0.32 engine gives chat requests with
tools, tool calls, documents, template kwargs and continue_final_message, through its
`POST /tokenize` (which renders as a chat completion does, but for `documents`, which it does not
pass on: they are left out here), for each template of
templates.json. The engine serves the repository's BOS model (`scripts/real-vllm/setup.sh`)
and is started with `--trust-request-chat-template`, so each request names its template.
Run: python3 vllm_tokenize.py URL (the engine's base URL). The Rust test parses each body
(without its `chat_template`) and compares the ids.
"""
import json, os, sys, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
url = sys.argv[1].rstrip("/") + "/tokenize"
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
    {"messages": [{"role": "system", "content": "s", "name": "sys1", "foo": 1},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "thinking done", "reasoning": "r"},
                  {"role": "user", "content": []}]},
    {"messages": [{"role": "user", "content": "Complete"}, {"role": "assistant", "content": "It is"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "  /go fast "}], "add_generation_prompt": False},
]
cases = []
for name, template in templates.items():
    for body in bodies:
        request = dict(body, model="tiny", chat_template=template)
        req = urllib.request.Request(url, data=json.dumps(request).encode(), headers={"content-type": "application/json"})
        try:
            answer = json.load(urllib.request.urlopen(req))
            cases.append({"template": name, "body": body, "tokens": answer["tokens"]})
        except urllib.error.HTTPError as e:
            cases.append({"template": name, "body": body, "error": json.load(e)})
json.dump({"vllm": "0.32.0", "cases": cases}, open(os.path.join(HERE, "vllm_tokenize.json"), "w"), indent=1, ensure_ascii=False)
print(len(cases), "cases,", sum("error" in c for c in cases), "refused")
