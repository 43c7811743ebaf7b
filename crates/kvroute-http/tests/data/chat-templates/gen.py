"""Writes cases.json: chat templates rendered by Hugging Face's `apply_chat_template` (what vLLM
calls), on conversations with tools, documents, `continue_final_message` and template kwargs.
The Rust test renders the same with kvroute's `Model` and compares the text exactly.
Run: python3 gen.py (needs `transformers`; any tokenizer directory of the repository serves,
the templates are set on it).
"""
import json, os

from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
tok = AutoTokenizer.from_pretrained(os.path.join(HERE, "..", "bos-model"))
templates = json.load(open(os.path.join(HERE, "templates.json")))

tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city — °C, « quoted »",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
documents = [{"title": "Doc <1>", "text": "Café & crème, \"quoted\"\nnew line"}]
conversations = [
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi there!\n"}],
    [{"role": "user", "content": "/run  tests "}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "  and then? "}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
    [{"role": "user", "content": "Complete this"}, {"role": "assistant", "content": "The answer is"}],
]
cases = []
for name, template in templates.items():
    for i, messages in enumerate(conversations):
        for options in [
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"add_generation_prompt": True, "tools": tools},
            {"add_generation_prompt": True, "documents": documents, "tools": tools},
            {"add_generation_prompt": True, "enable_thinking": False},
            {"add_generation_prompt": False, "continue_final_message": True},
        ]:
            if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
                continue
            kwargs = dict(options)
            try:
                rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
            except Exception as e:  # a template may refuse a conversation
                rendered = None
            cases.append({"template": name, "messages": messages, "options": options, "rendered": rendered})
json.dump({"templates": templates, "cases": cases}, open(os.path.join(HERE, "cases.json"), "w"), indent=1, ensure_ascii=False)
print(len(cases), "cases,", sum(c["rendered"] is None for c in cases), "refused")
