"""The OpenAI-compatible server (`tandem serve`): API process in front of an engine core process."""
