"""Generation engines behind one small interface (:class:`InferenceEngine`)."""
