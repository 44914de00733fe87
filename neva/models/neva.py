"""NeVA glue: vision tower → projector → features spliced into the decoder's token embeddings."""

from __future__ import annotations

import torch
from torch import nn

from neva.models.anyres import AnyResMerge
from neva.models.config import NevaConfig
from neva.models.context_shard import ContextShard
from neva.models.decoder_traits import traits
from neva.models.deepstack import layer_additions
from neva.models.features import VisualFeatures
from neva.models.gated_deltanet import RecurrentCache
from neva.models.llama import KVCache, LlamaDecoder, new_layer_caches
from neva.models.media import GeneratedText, Media, MediaInputs
from neva.models.projector import build_projector, init_projector
from neva.models.towers import build_tower
from neva.models.video import VideoPool, find_video_positions


class NevaModel(nn.Module):
    """LLaVA-style model. Knows nothing of parallelism; any part may be None on a pipeline stage.

    Build on the meta device for large models (``with torch.device("meta"): NevaModel(cfg)``), then parallelize,
    then ``to_empty(device=...)`` and ``init_weights()`` or load weights.
    """

    def __init__(self, cfg: NevaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision: nn.Module | None = build_tower(cfg.vision) if cfg.vision is not None else None
        self.projector: nn.Sequential | None = build_projector(cfg.projector) if cfg.projector is not None else None
        self.llm = LlamaDecoder(cfg.llm)
        # AnyRes: the tile-feature layout and its learned newline (None: one fixed-size tile per image).
        self.anyres: AnyResMerge | None = AnyResMerge(cfg.anyres, cfg.llm.hidden_size) if cfg.anyres else None
        # Video: frames pooled per frame between tower and projector (no parameters); None: no video input.
        self.video_pool: VideoPool | None = VideoPool(cfg.video) if cfg.video else None

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features ``[N, num_image_tokens, llm_hidden]``; a frozen tower runs without autograd."""
        return self.projector(self._tower_features(pixel_values))

    def video_features(self, video_pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected frame features ``[F, frame tokens, llm_hidden]``: all frames through the tower as one batch,
        pooled per frame, then projected."""
        return self.projector(self.video_pool(self._tower_features(video_pixel_values)))

    def _tower_features(self, pixel_values: torch.Tensor, grid: torch.Tensor | None = None) -> torch.Tensor:
        # A native-resolution tower reads its items' patch grids besides the flattened patches.
        args = (pixel_values,) if grid is None else (pixel_values, grid)
        if any(p.requires_grad for p in self.vision.parameters()):
            return self.vision.features(*args)
        with torch.no_grad():
            return self.vision.features(*args)

    def embed(
        self, input_ids: torch.Tensor, media: Media | None = None, context: ContextShard | None = None
    ) -> torch.Tensor:
        """Token embeddings with each modality's features written over its positions (images, then video)."""
        return self.embed_with_additions(input_ids, media, context)[0]

    def embed_with_additions(
        self, input_ids: torch.Tensor, media: Media | None = None, context: ContextShard | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """``embed``'s hidden states and what the decoder adds to its residual stream after named layers
        (``LlamaDecoder.forward``'s ``layer_additions``: Qwen3-VL's DeepStack features, ``neva.models.deepstack``;
        None for every other model).

        Args:
            input_ids: ``[B, S]``; each image occupies its count of consecutive ``image_token_id`` positions.
            media: the micro-batch's images and videos (``neva.models.media``); None: text only.
            context: context parallelism (``neva.models.context_shard``): ``input_ids`` are this rank's columns; each
                rank encodes its share of the tower inputs and writes the gathered features at its own positions.

        While gradients are recorded, a modality the model has and the micro-batch lacks runs as an empty one, so
        every rank runs the same modules (``neva.models.media``). Outside training mode, ids holding tokens of a
        modality given no inputs are refused (a check that reads the device: the training step has none).

        Raises:
            ValueError: a row whose image-token count is not its image count × tokens per image, naming the row.
        """
        if media is not None and not isinstance(media, Media):
            raise TypeError(f"media must be a neva.models.media.Media, got {type(media).__name__}")
        media = media or Media()
        h_BSD = self.llm.embed(self._embedding_ids(input_ids))
        placed = []  # (positions, DeepStack features) per modality that has them
        for modality, inputs in media.items():
            if modality not in self.modalities:
                if inputs is not None and not inputs.is_empty:
                    raise ValueError(f"{modality} input given to a model without {modality} (NevaConfig.{modality})")
                continue
            if inputs is None:
                # serving, evaluation: the ids must hold none of its tokens (reads the device), but generated ones
                if not self.training and not isinstance(media, GeneratedText):
                    self._check_no_tokens(input_ids, modality, media)
                if not torch.is_grad_enabled():
                    continue
                inputs = self._empty_inputs(modality, h_BSD.device)
            h_BSD, positions, deepstack = self._splice(h_BSD, input_ids, modality, inputs, context)
            if deepstack:
                placed.append((positions, deepstack))
        return h_BSD, layer_additions(h_BSD, placed, self.cfg.deepstack_layers)

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media this model reads: images with a tower and projector, video where it pools frames or where a
        native-resolution model has its video token (``NevaConfig.patch_video``: the same tower and merger)."""
        if self.vision is None or self.projector is None:
            return ()
        return ("image", "video") if self.video_pool is not None or self.cfg.patch_video else ("image",)

    def _empty_inputs(self, modality: str, device: torch.device) -> MediaInputs:
        # The tower says what an input without images is (its shape is the tower kind's own).
        return MediaInputs.empty(
            self.vision.empty_input(device),
            anyres=modality == "image" and bool(self.anyres),
            grid=self.cfg.vision.spec.patch_grid,
        )

    def _token(self, modality: str) -> int:
        return self.cfg.image_token_id if modality == "image" else self.cfg.video_token

    def _check_no_tokens(self, input_ids: torch.Tensor, modality: str, media: Media) -> None:
        shared = self.cfg.video is not None and self.cfg.video_token == self.cfg.image_token_id
        if shared and (modality == "video" or media.video is not None):
            return  # one id for both: the tokens are the video's, or the image check covers them
        rows = (input_ids == self._token(modality)).any(dim=1)
        if rows.any():
            raise ValueError(
                f"sample(s) {rows.nonzero().flatten().tolist()} contain {modality} tokens but no {modality}s were given"
            )

    def _features(self, modality: str, inputs: MediaInputs, context: ContextShard | None = None) -> VisualFeatures:
        """``main`` ``[M, D]``: the features of every position of ``modality``, in position order (under ``context``,
        each rank's share of the tower inputs encoded there and gathered); ``deepstack``: one ``[M, D]`` per
        DeepStack layer (Qwen3-VL; empty for every other model)."""
        if inputs.grid is not None:  # native resolution: the merger's output is already one row per position
            if context is None:
                return self._native_features(inputs.pixels, inputs.grid)
            merge = self.cfg.vision.spatial_merge_size
            return context.encode_native_shared(self._native_features, inputs.pixels, inputs.grid, merge, modality)
        encode = self.video_features if modality == "video" else self.image_features
        feats_NTD = encode(inputs.pixels) if context is None else context.encode_shared(encode, inputs.pixels, modality)
        if modality == "video" or inputs.index is None:
            return VisualFeatures(feats_NTD.flatten(0, 1))
        return VisualFeatures(self.anyres(feats_NTD, inputs.index, inputs.weight))

    def _native_features(self, pixels: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        """A native-resolution tower's patches ``[L, C·T·P·P]`` of the items of ``grid`` through tower and merger."""
        return self.projector(self._tower_features(pixels, grid))

    def _splice(
        self,
        h_BSD: torch.Tensor,
        input_ids: torch.Tensor,
        modality: str,
        inputs: MediaInputs,
        context: ContextShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``h_BSD`` with the modality's features written at its positions; those positions and its DeepStack
        features (a native tower's; under ``context`` those of this rank's positions, as the main features)."""
        positions = inputs.positions
        if positions is None:  # serving: found from the ids (reads the device)
            positions = self._positions_from_ids(input_ids, modality, inputs)
        features = self._features(modality, inputs, context)
        if inputs.feature_rows is not None:  # positions that share items' features (a preference pair's two rows)
            features = features.rows(inputs.feature_rows)
        feats_MD = features.main.to(h_BSD.dtype)
        deepstack = features.deepstack
        if context is not None:  # the features of this rank's positions
            feats_MD = context.local_features(modality, feats_MD)
            deepstack = [context.local_features(modality, d) for d in deepstack]
        if positions.shape[0] != feats_MD.shape[0]:  # shapes only: no sync
            raise ValueError(
                f"{positions.shape[0]} {modality} positions given for {feats_MD.shape[0]} {modality} features "
                f"({inputs.pixels.shape[0]} tower inputs)"
            )
        return _index_put(h_BSD, positions, feats_MD), positions, deepstack

    def _positions_from_ids(self, input_ids: torch.Tensor, modality: str, inputs: MediaInputs) -> torch.Tensor:
        if modality == "video":
            if self.cfg.video_token == self.cfg.image_token_id:
                raise ValueError("video positions are needed where videos and images share one token id")
            return find_video_positions(input_ids, self.cfg.video_token)
        is_image_BS = input_ids == self.cfg.image_token_id
        found_B = is_image_BS.sum(dim=1)
        counts, tokens = inputs.items_per_row, inputs.tokens
        if tokens is None:
            per_image = self.cfg.num_image_tokens
            if counts is None:
                counts = torch.div(found_B, per_image, rounding_mode="floor")
            expected_B = counts.to(found_B.device) * per_image
            images, given = int(counts.sum()), inputs.pixels.shape[0]
        else:  # variable positions per image (AnyRes): each row's images' counts summed
            if counts is None:
                raise ValueError("image tokens (positions per image) need image counts (images per row)")
            rows_N = torch.repeat_interleave(torch.arange(len(counts)), counts.cpu()).to(found_B.device)
            expected_B = torch.zeros_like(found_B).index_add_(0, rows_N, tokens.to(found_B.device))
            per_image, images, given = tokens.tolist(), int(counts.sum()), len(tokens)
        if not torch.equal(found_B, expected_B) or images != given:
            bad = (found_B != expected_B).nonzero().flatten().tolist()
            raise ValueError(
                f"image token count mismatch in sample(s) {bad}: found {found_B.tolist()} image positions, expected "
                f"{expected_B.tolist()} ({counts.tolist()} images × {per_image} tokens); "
                f"{inputs.pixels.shape[0]} images given"
            )
        return is_image_BS.nonzero()

    def _embedding_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids to look up: an image (or video) token without its own row reads row 0 (the splice overwrites it)."""
        vocab = self.cfg.llm.vocab_size
        if self.cfg.image_token_has_row and (self.cfg.video is None or self.cfg.video_token < vocab):
            return input_ids
        return input_ids.masked_fill(input_ids >= vocab, 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        media: Media | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: list[KVCache] | None = None,
        output_positions: torch.Tensor | None = None,
        dropout_keys: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        context: ContextShard | None = None,
        shared_prefix: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` (or hidden states on a stage without the LM head).

        ``media``: see ``embed``. ``output_positions`` ``[N, 2]`` (row, column) limits the LM head to those positions
        (logits ``[N, V]``). ``dropout_keys`` ``[B, S]`` (``neva.models.lora.token_dropout_keys``) key the LoRA
        adapters' dropout masks. ``token_mask`` ``[B, S]``: tokens MoE routers count for load balancing
        (``LlamaDecoder.forward``). ``context``: this forward holds a shard of every row's columns (context
        parallelism, ``neva.models.context_shard``). ``shared_prefix``: each row is a prompt and completions of it
        (``LlamaDecoder.forward``).

        On a stage without ``tok_embeddings``, ``input_ids`` are the previous stage's hidden states.
        """
        h, additions = input_ids, None  # a stage without tok_embeddings: the previous stage's hidden states
        if self.llm.tok_embeddings is not None:
            h, additions = self.embed_with_additions(input_ids, media, context)
        bidirectional = self._bidirectional(input_ids, media) if traits(self.cfg.llm).bidirectional_images else None
        return self.llm(
            h,
            bidirectional=bidirectional,
            layer_additions=additions,
            position_ids=position_ids,
            segment_ids=segment_ids,
            cache=cache,
            output_positions=output_positions,
            token_mask=token_mask,
            dropout_keys=dropout_keys,
            context=context,
            shared_prefix=shared_prefix,
        )

    def _bidirectional(self, input_ids: torch.Tensor, media: Media | None) -> torch.Tensor | None:
        """``[M, 2]`` (row, column) image positions, whose runs attend both ways (Gemma 3; None: no image here).

        The images' positions where given (training: the collator's host tensors, on every pipeline stage), else found
        from the ids (serving, on the stage that embeds: ``input_ids`` are ids there)."""
        image = None if media is None else media.image
        if image is None:
            return None
        if image.positions is not None:
            return image.positions
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError("bidirectional image attention on a stage without ids needs the images' positions")
        return (input_ids == self.cfg.image_token_id).nonzero()

    def tie_weights(self) -> None:
        """Share the LM head with the token embedding when configured (``to_empty`` breaks the sharing)."""
        llm = self.llm
        if self.cfg.llm.tie_word_embeddings and llm.output is not None and llm.tok_embeddings is not None:
            llm.output.weight = llm.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter (after ``to_empty``) and recompute non-persistent buffers."""
        if self.vision is not None:
            self.vision.init_weights()
        if self.projector is not None:
            init_projector(self.projector)
        if self.anyres is not None:
            self.anyres.init_weights()
        self.llm.init_weights()

    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> list[KVCache | RecurrentCache]:
        """Empty decoding caches for this model's decoder layers (``neva.models.llama.new_layer_caches``)."""
        cfg = self.cfg.llm
        param = next(self.llm.layers.parameters())
        layers = list(self.llm.layers.keys())
        return new_layer_caches(
            cfg, layers, batch_size, max_len, cfg.num_kv_heads, device or param.device, dtype or param.dtype
        )


def _index_put(h_BSD: torch.Tensor, positions: torch.Tensor, feats_MD: torch.Tensor) -> torch.Tensor:
    """``h_BSD`` with ``feats_MD`` written at the ``[M, 2]`` (row, column) ``positions`` (an index op: no sync)."""
    positions = positions.to(h_BSD.device)
    return h_BSD.index_put((positions[:, 0], positions[:, 1]), feats_MD)
