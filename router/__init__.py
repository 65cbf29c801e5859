"""kvrouter's HTTP gateway: OpenAI surface, tokenization, policies, proxying."""

import os

# transformers warns at import that PyTorch is missing: the router only tokenizes, and never needs it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
