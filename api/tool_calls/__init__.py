"""Tool calling on /v1/chat/completions, as vLLM serves it.

- `schemas`: the request's `tools`, `tool_choice` and the assistant's `tool_calls` (OpenAI's shapes).
- `choice`: what a request's tool_choice means here: no tools, the model's own calls parsed
  (`auto`, with the server's --tool-call-parser), or calls forced by structured outputs
  (`required`, a named function); the JSON schema that forces them.
- `parsers`: a model's text to its content and tool calls, per family (Llama 3 JSON,
  Hermes/Qwen, Mistral) and for the forced shapes; the same parse serves a finished text and
  one still being streamed.
- `json_scan`: reads JSON values out of text that may end mid-value.
- `deltas`: a streamed output's text to OpenAI's chunk deltas (content, then tool-call
  id, name and argument fragments).
"""
