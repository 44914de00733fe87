"""NeVA glue: vision tower → projector → features spliced into the decoder's token embeddings."""

from __future__ import annotations

import torch
from torch import nn

from neva.models.anyres import AnyResMerge
from neva.models.config import NevaConfig
from neva.models.llama import KVCache, LlamaDecoder
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

    def _tower_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if any(p.requires_grad for p in self.vision.parameters()):
            return self.vision.features(pixel_values)
        with torch.no_grad():
            return self.vision.features(pixel_values)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_counts: torch.Tensor | None = None,
        image_positions: torch.Tensor | None = None,
        image_feature_index: torch.Tensor | None = None,
        image_tokens: torch.Tensor | None = None,
        image_feature_weight: torch.Tensor | None = None,
        video_pixel_values: torch.Tensor | None = None,
        video_frames: torch.Tensor | None = None,
        video_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image features written over the image-token positions, then video features over the
        video-token positions.

        Args:
            input_ids: ``[B, S]``; each image occupies ``num_image_tokens`` consecutive ``image_token_id`` positions.
            pixel_values: ``[N, C, H, W]``, all images of the batch in row order, or None.
            image_counts: ``[B]`` images per row; None infers it from the image-token counts.
            image_positions: ``[M, 2]`` (row, column) of every image-token position in feature order, as the
                collator finds them on the host: the splice is then an index op, with no host-device sync (the
                checks below read device values). None finds and checks the positions here.
            image_feature_index: AnyRes only: ``[M]`` row of the batch's flattened tile features for every image
                position (``neva.models.anyres.feature_index``, offset per image by the collator), -1 the newline;
                ``pixel_values`` then holds every tile.
            image_tokens: ``[N]`` positions per image (AnyRes: the length of its feature index); None: every image
                takes ``num_image_tokens``.
            image_feature_weight: AnyRes pooled (``anyres_max_N``) only: ``[M, 4]`` bilinear weights of the rows
                ``image_feature_index`` ``[M, 4]`` names (``neva.models.anyres.pool_grid``).
            video_pixel_values: ``[F, C, H, W]``, every frame of every video of the batch (row order, then position
                order, each video's frames in time order), or None.
            video_frames: ``[V]`` frames per video (the collator's; the splice needs only the positions).
            video_positions: ``[M_v, 2]`` (row, column) of every video-token position in feature order
                (``NevaConfig.video_tokens(frames)`` per video), from the collator; None: found here from the
                ``video_token`` ids (serving; needs ``video_token_id`` distinct from the image token).

        Raises:
            ValueError: a row whose image-token count is not its image count × tokens per image, naming the row.
        """
        h_BSD = self._embed_images(
            input_ids, pixel_values, image_counts, image_positions, image_feature_index, image_tokens,
            image_feature_weight,
        )  # fmt: skip
        if video_pixel_values is None or video_pixel_values.shape[0] == 0:
            return h_BSD
        if video_positions is None:
            if self.cfg.video_token == self.cfg.image_token_id:
                raise ValueError("video_positions are needed where videos and images share one token id")
            video_positions = find_video_positions(input_ids, self.cfg.video_token)
        return self._splice_video(h_BSD, video_pixel_values, video_positions)

    def _embed_images(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_counts: torch.Tensor | None,
        image_positions: torch.Tensor | None,
        image_feature_index: torch.Tensor | None,
        image_tokens: torch.Tensor | None,
        image_feature_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        h_BSD = self.llm.tok_embeddings(self._embedding_ids(input_ids))
        if image_positions is not None:
            return self._splice(h_BSD, pixel_values, image_positions, image_feature_index, image_feature_weight)
        is_image_BS = input_ids == self.cfg.image_token_id
        if pixel_values is None or pixel_values.shape[0] == 0:
            if is_image_BS.any():
                rows = is_image_BS.any(dim=1).nonzero().flatten().tolist()
                raise ValueError(f"sample(s) {rows} contain image tokens but no images were given")
            return self._keep_projector(h_BSD)
        per_image = self.cfg.num_image_tokens
        found_B = is_image_BS.sum(dim=1)
        if image_tokens is None:
            if image_counts is None:
                image_counts = torch.div(found_B, per_image, rounding_mode="floor")
            expected_B = image_counts.to(found_B.device) * per_image
            images, given = int(image_counts.sum()), pixel_values.shape[0]
        else:  # variable positions per image (AnyRes): each row's images' counts summed
            if image_counts is None:
                raise ValueError("image_tokens (positions per image) need image_counts (images per row)")
            rows_N = torch.repeat_interleave(torch.arange(len(image_counts)), image_counts.cpu()).to(found_B.device)
            expected_B = torch.zeros_like(found_B).index_add_(0, rows_N, image_tokens.to(found_B.device))
            per_image, images, given = image_tokens.tolist(), int(image_counts.sum()), len(image_tokens)
        if not torch.equal(found_B, expected_B) or images != given:
            bad = (found_B != expected_B).nonzero().flatten().tolist()
            raise ValueError(
                f"image token count mismatch in sample(s) {bad}: found {found_B.tolist()} image positions, expected "
                f"{expected_B.tolist()} ({image_counts.tolist()} images × {per_image} tokens); "
                f"{pixel_values.shape[0]} images given"
            )
        feats_MD = self._features(pixel_values, image_feature_index, image_feature_weight).to(h_BSD.dtype)
        return h_BSD.masked_scatter(is_image_BS[..., None], feats_MD)

    def _features(
        self,
        pixel_values: torch.Tensor,
        image_feature_index: torch.Tensor | None,
        image_feature_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, D]``: the features of every image position, in position order."""
        feats_NTD = self.image_features(pixel_values)
        if image_feature_index is None:
            return feats_NTD.flatten(0, 1)
        return self.anyres(feats_NTD, image_feature_index, image_feature_weight)

    def _embedding_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids to look up: an image (or video) token without its own row reads row 0 (the splice overwrites it)."""
        vocab = self.cfg.llm.vocab_size
        if self.cfg.image_token_has_row and (self.cfg.video is None or self.cfg.video_token < vocab):
            return input_ids
        return input_ids.masked_fill(input_ids >= vocab, 0)

    def _keep_projector(self, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.projector is not None and torch.is_grad_enabled():
            # A text-only batch keeps the projector in the graph with an empty input (LLaVA's ``[0:0]`` image
            # slice): in pretraining it is all that trains, and the loss must still reach it (zero gradients).
            empty = h_BSD.new_zeros(0, self.cfg.projector.input_size)
            h_BSD = h_BSD + self.projector(empty).sum().to(h_BSD.dtype)
        return h_BSD

    def _splice(
        self,
        h_BSD: torch.Tensor,
        pixel_values: torch.Tensor | None,
        positions: torch.Tensor,
        feature_index: torch.Tensor | None = None,
        feature_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        images = 0 if pixel_values is None else pixel_values.shape[0]
        expected = images * self.cfg.num_image_tokens if feature_index is None else feature_index.shape[0]
        if positions.shape[0] != expected:  # shapes only: no sync
            raise ValueError(
                f"{positions.shape[0]} image positions given for {expected} image features ({images} tiles or images)"
            )
        if images == 0:
            return self._keep_projector(h_BSD)
        feats_MD = self._features(pixel_values, feature_index, feature_weight).to(h_BSD.dtype)
        return _index_put(h_BSD, positions, feats_MD)

    def _splice_video(self, h_BSD: torch.Tensor, frames: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.video_pool is None:
            raise ValueError("video input given to a model without video (NevaConfig.video is not set)")
        feats_MD = self.video_features(frames).flatten(0, 1).to(h_BSD.dtype)
        if positions.shape[0] != feats_MD.shape[0]:  # shapes only: no sync
            raise ValueError(
                f"{positions.shape[0]} video positions given for {feats_MD.shape[0]} video features "
                f"({frames.shape[0]} frames)"
            )
        return _index_put(h_BSD, positions, feats_MD)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_counts: torch.Tensor | None = None,
        image_positions: torch.Tensor | None = None,
        image_feature_index: torch.Tensor | None = None,
        image_tokens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: list[KVCache] | None = None,
        output_positions: torch.Tensor | None = None,
        dropout_keys: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        image_feature_weight: torch.Tensor | None = None,
        video_pixel_values: torch.Tensor | None = None,
        video_frames: torch.Tensor | None = None,
        video_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` (or hidden states on a stage without the LM head).

        ``output_positions`` ``[N, 2]`` (row, column) limits the LM head to those positions (logits ``[N, V]``).
        ``image_positions``, ``image_feature_index``, ``image_tokens``, ``image_feature_weight``, the ``video_*``
        inputs: see ``embed``.
        ``dropout_keys`` ``[B, S]`` (``neva.models.lora.token_dropout_keys``) key the LoRA adapters' dropout masks.
        ``token_mask`` ``[B, S]``: tokens MoE routers count for load balancing (``LlamaDecoder.forward``).

        On a stage without ``tok_embeddings``, ``input_ids`` are the previous stage's hidden states.
        """
        if self.llm.tok_embeddings is not None:
            h = self.embed(
                input_ids, pixel_values, image_counts, image_positions, image_feature_index, image_tokens,
                image_feature_weight, video_pixel_values, video_frames, video_positions,
            )  # fmt: skip
        else:
            h = input_ids
        return self.llm(
            h,
            position_ids=position_ids,
            segment_ids=segment_ids,
            cache=cache,
            output_positions=output_positions,
            token_mask=token_mask,
            dropout_keys=dropout_keys,
        )

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

    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> list[KVCache]:
        """Empty KV caches for this model's decoder layers."""
        cfg = self.cfg.llm
        param = next(self.llm.layers.parameters())
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        kw = dict(device=device or param.device, dtype=dtype or param.dtype)
        return [KVCache(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in self.llm.layers]


def _index_put(h_BSD: torch.Tensor, positions: torch.Tensor, feats_MD: torch.Tensor) -> torch.Tensor:
    """``h_BSD`` with ``feats_MD`` written at the ``[M, 2]`` (row, column) ``positions`` (an index op: no sync)."""
    positions = positions.to(h_BSD.device)
    return h_BSD.index_put((positions[:, 0], positions[:, 1]), feats_MD)
