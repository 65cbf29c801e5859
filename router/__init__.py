"""kvrouter's HTTP gateway: OpenAI surface, tokenization, policies, proxying."""
