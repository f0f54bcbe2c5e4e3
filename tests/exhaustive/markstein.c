// Exhaustive check: for every positive finite fp16 scale s and every finite fp16 / bf16 x,
// Markstein's corrected product q = fma(fma(-q0, s, x), r, q0), q0 = x * r, r = RN(1/s)
// equals RN(x / s) bit for bit (up to the sign of zero).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static float f16(uint16_t h) {
    uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    return sign ? -v : v;
}
static float bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

int main(void) {
    static float xs16[65536], xsbf[65536];
    int n16 = 0, nbf = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if (((h >> 10) & 0x1f) != 0x1f) xs16[n16++] = f16((uint16_t)h);
        if (((h >> 7) & 0xff) != 0xff) xsbf[nbf++] = bf16((uint16_t)h);
    }
    for (int pass = 0; pass < 2; pass++) {
        const float *xs = pass ? xsbf : xs16;
        int n = pass ? nbf : n16;
        long long pairs = 0, in_range = 0, mismatch_in = 0, mismatch_out = 0;
        float worst_in = 0.0f, worst_q = 0.0f;  // largest |RN(x/s)|, |q| among in-range mismatches
        for (uint32_t hs = 1; hs < 0x7c00; hs++) {
            float s = f16((uint16_t)hs);
            float r = 1.0f / s;
            for (int i = 0; i < n; i++) {
                float x = xs[i];
                float q0 = x * r;
                float e = fmaf(-q0, s, x);
                float q = fmaf(e, r, q0);
                float want = x / s;
                int inside = fabsf(x) <= 126.5f * s;  // exact product: 11 + 8 bits
                pairs++;
                in_range += inside;
                if (bits(q) != bits(want) && !(q == 0.0f && want == 0.0f)) {
                    if (inside) {
                        mismatch_in++;
                        if (fabsf(want) > worst_in) worst_in = fabsf(want);
                        if (fabsf(q) > worst_q) worst_q = fabsf(q);
                        if (mismatch_in <= 2) printf("  in-range mismatch x=%a s=%a q=%a want=%a\n", x, s, q, want);
                    } else {
                        mismatch_out++;
                    }
                }
            }
        }
        printf("%s x: %lld pairs, %lld with |x| <= 126.5 s: mismatches there %lld (largest |x/s| %a, |q| %a), elsewhere %lld\n",
               pass ? "bf16" : "fp16", pairs, in_range, mismatch_in, worst_in, worst_q, mismatch_out);
    }
    return 0;
}
