"""Engines behind one small protocol (`protocol.Engine`): torch (embedded default), mock, sglang."""
