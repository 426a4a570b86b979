"""Stand-ins for vLLM model classes of other versions, to prove the capture checks fail
when the installed code differs from what a strategy depends on."""


class OldDecoderLayer:  # vLLM < 0.12: no llama_4_scaling argument
    def forward(self, positions, hidden_states, residual): ...


class OldModel:  # vLLM < 0.12: get_input_embeddings, no aux capture
    def get_input_embeddings(self, input_ids): ...

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None): ...


class OldForCausalLM:
    pass


class KeywordOnlyDecoderLayer:  # a layer whose parameters are in another order
    def forward(self, hidden_states, positions, residual, llama_4_scaling=None): ...


class NoDelegateWrapper:  # a multimodal wrapper that runs its own text stack
    def __init__(self, text_config):
        self.layers = []

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None): ...
