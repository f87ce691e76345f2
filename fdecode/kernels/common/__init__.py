"""What every kernel shares: the block math (`block`), the score modifiers (`modifiers`),
sparse index lists (`sparse`), the 8-bit cache format (`quant`) and the chips' data
(`chips`)."""
