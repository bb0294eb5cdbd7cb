import numpy as np
import pytest
import tensorflow as tf

from framework.models import MultiHeadAttention, TransformerBlock, VisionTransformer, vit_b16


def test_vit_b16_has_the_papers_parameter_count():
    assert vit_b16().count_params() == 86_567_656


def test_checkpoint_holds_every_weight_of_the_model(tmp_path):
    model = VisionTransformer(
        image_size=8, patch_size=4, num_classes=2, dim=8, depth=2, num_heads=2, mlp_dim=8
    )
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    saved = [name for name, _ in tf.train.list_variables(path) if name.startswith("model/")]
    assert len(saved) == len(model.weights)


def test_vit_maps_images_to_logits():
    model = VisionTransformer(
        image_size=16, patch_size=4, num_classes=5, dim=32, depth=2, num_heads=4, mlp_dim=64
    )
    logits = model(tf.random.normal([3, 16, 16, 3]))
    assert logits.shape == (3, 5) and logits.dtype == tf.float32
    assert len(model.blocks) == 2 and all(isinstance(b, TransformerBlock) for b in model.blocks)


def test_attention_mask_blocks_masked_keys():
    layer = MultiHeadAttention(num_heads=2)
    x = tf.random.normal([1, 4, 8])
    mask = tf.constant([True, True, False, False])[None, None, None, :]
    changed = tf.concat([x[:, :2], tf.random.normal([1, 2, 8])], axis=1)
    np.testing.assert_allclose(
        layer(x, attention_mask=mask)[:, :2],
        layer(changed, attention_mask=mask)[:, :2],
        rtol=1e-5,
        atol=1e-6,
    )


def test_dropout_only_in_training():
    block = TransformerBlock(num_heads=2, mlp_dim=16, dropout=0.5)
    x = tf.random.normal([2, 4, 8])
    np.testing.assert_array_equal(block(x, training=False), block(x, training=False))
    assert not np.allclose(block(x, training=True), block(x, training=False))


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of patch_size"):
        VisionTransformer(image_size=30, patch_size=4)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        MultiHeadAttention(num_heads=3)(tf.zeros([1, 2, 8]))
