"""Draft heads that read the target's own hidden states: Medusa (Cai et al. 2024) and EAGLE
(Li et al. 2024). Defined, trained on this machine (`specgen train`), saved and loaded here;
the drafters that use them are in speccli.drafters.heads."""
