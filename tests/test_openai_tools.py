"""Tool calls parsed back from replies in the Qwen (Hermes) and Llama 3.1 formats, and the format
picked from the chat template; pure string handling (no server)."""

import json

import pytest

from hf_fixtures import LLAMA3_TEMPLATE, QWEN25_TEMPLATE
from jaxrl.serving.chat_tools import (RequestError, check_tools, parse_tool_calls,
                                      template_messages, tool_format)


def _calls(calls):
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_format_follows_the_template():
  assert tool_format(QWEN25_TEMPLATE) == "qwen"
  assert tool_format(LLAMA3_TEMPLATE) == "llama3"
  assert tool_format("{{ messages }}") == tool_format(None) == "none"


def test_qwen_calls_and_the_text_before_them():
  text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n'
          '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
  content, calls = parse_tool_calls(text, "qwen")
  assert content == "Let me compute."
  assert _calls(calls) == [("calc", {"expr": "2+3"}), ("now", {})]
  assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
  assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", ['<tool_call>{"name": "calc", "arguments": </tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  'no call at all'])
def test_a_call_that_does_not_parse_stays_text(text):
  assert parse_tool_calls(text, "qwen") == (text, [])


def test_llama3_json_calls():
  content, calls = parse_tool_calls('<|python_tag|>{"name": "calc", "parameters": {"expr": "1"}}'
                                    '; {"name": "now", "parameters": {}}', "llama3")
  assert content is None and _calls(calls) == [("calc", {"expr": "1"}), ("now", {})]
  assert parse_tool_calls("The answer is 5.", "llama3") == ("The answer is 5.", [])
  assert parse_tool_calls('{"name": "calc", "parameters": {', "llama3")[1] == []


def test_tool_schemas_are_checked_and_past_calls_rendered_as_objects():
  good = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
  assert check_tools(good) == good and check_tools(None) is None
  with pytest.raises(RequestError) as e:
    check_tools([{"type": "function", "function": {"name": "bad name"}}])
  assert e.value.param == "tools[0].function.name" and e.value.status == 400
  msgs = template_messages([
      {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3"}]},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "c", "type": "function",
           "function": {"name": "calc", "arguments": '{"expr": "2+3"}'}}]}])
  assert msgs[0]["content"] == "2+3"
  assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"expr": "2+3"}
  with pytest.raises(RequestError, match="non-empty list"):
    template_messages([])
