"""hearthlm: embeddable async LLM inference."""
