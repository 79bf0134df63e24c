"""Agents on the chat format: the embedded stdlib lookup task (its tools, conversations and split) and the
agent evaluation through the OpenAI API (`k3 eval-agent`)."""
