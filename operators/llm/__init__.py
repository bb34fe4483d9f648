"""Talking to a code-writing LLM: a chat client for any OpenAI-compatible endpoint (`client`) and the
search/replace edits its replies propose (`edits`). Neither module imports Ray, MLflow or torch."""
