"""k auto: pass costs measured and cached, and the policies that choose how much to draft."""
