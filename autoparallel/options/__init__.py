"""Stage 2, options: placement options for every node of the joint graph
(DTensor's strategies, the rules DTensor lacks, conversion, pruning)."""
